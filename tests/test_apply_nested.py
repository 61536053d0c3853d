"""Nested (multi-level) checkpointed regions: segments recomputed inside another segment's recompute.

Bit-exact losses and gradients against no checkpointing (dropout, BatchNorm, bf16 autocast,
op-level keeps in an inner block), the number of times each block runs in the backward
(torch's early stop at every level), lower backward peak memory, hook order, undo and errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import TinyCNN, train_steps
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker


class Block(nn.Module):
    """Linear -> GELU -> Dropout with a residual; counts its forward calls."""

    def __init__(self, d: int = 16, p: float = 0.2) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(p)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(nn.functional.gelu(self.fc(x)))


class Chain(nn.Module):
    def __init__(self, n_blocks: int = 8, d: int = 16, p: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n_blocks))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def batches(n: int = 3, d: int = 16):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, d, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def train(segments=None, inner=(), keep_ops=None, n_blocks=8, steps=3, autocast=False, early_stop=True):
    torch.manual_seed(0)
    model = Chain(n_blocks)
    handle = None
    if segments:
        handle = apply_segments(
            list(model.blocks), segments, inner_segments=inner, keep_ops=keep_ops, early_stop=early_stop
        )
    torch.manual_seed(123)  # the same dropout stream for every run
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses, grads = train_steps(model, batches(), steps)
    else:
        losses, grads = train_steps(model, batches(), steps)
    return model, handle, losses, grads


def assert_same_training(ref, run):
    _, _, ref_losses, ref_grads = ref
    _, _, losses, grads = run
    assert len(ref_losses) == len(losses) and all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert ref_grads.keys() == grads.keys() and len(grads) == 18
    for name in ref_grads:
        assert torch.equal(ref_grads[name], grads[name]), name


PLANS = {
    "two_inner": ([(0, 7)], [(0, 1), (3, 4)]),
    "depth_three": ([(0, 7)], [(0, 3), (1, 2), (5, 6)]),
    "shares_first_block": ([(0, 5), (6, 7)], [(0, 2), (0, 0)]),
    "shares_last_block": ([(1, 7)], [(4, 7), (6, 7)]),
    "inner_ends_the_outer": ([(0, 3), (4, 7)], [(1, 3), (4, 5), (6, 7)]),
    "one_block_inner": ([(0, 7)], [(i, i) for i in range(0, 8, 2)]),
}


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_nested_plans_train_bit_identically_with_dropout(plan):
    segments, inner = plan
    ref = train()
    run = train(segments, inner)
    assert_same_training(ref, run)
    _, handle, _, _ = run
    assert handle.segments == segments and handle.inner_segments == sorted(inner)
    assert all(seg.running == [] for seg in handle._segments)  # no recompute left marked as running


@pytest.mark.parametrize("name", ["depth_three", "shares_first_block"])
def test_nested_plans_bit_identical_under_bf16_autocast(name):
    assert_same_training(train(autocast=True), train(*PLANS[name], autocast=True))


def test_nested_plan_without_early_stop_and_with_a_second_backward():
    assert_same_training(train(), train(*PLANS["depth_three"], early_stop=False))
    torch.manual_seed(0)
    model = Chain(8)
    apply_segments(list(model.blocks), *PLANS["depth_three"])
    x, y = batches(1)[0]
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()  # every level recomputes again for the second backward
    assert all(torch.equal(2 * g, p.grad) for g, p in zip(first, model.parameters()))


def backward_calls(segments, inner, n_blocks=6):
    """How many times each block runs in one forward and in its backward."""
    torch.manual_seed(0)
    model = Chain(n_blocks)
    apply_segments(list(model.blocks), segments, inner_segments=inner)
    x, y = batches(1)[0]
    loss = nn.functional.cross_entropy(model(x), y)
    forward = [b.calls for b in model.blocks]
    for b in model.blocks:
        b.calls = 0
    loss.backward()
    return forward, [b.calls for b in model.blocks]


@pytest.mark.parametrize(
    "segments, inner, expected",
    [
        # the outer recompute runs 0..5 (block 5 saves), then (3, 4) and (0, 1) recompute again
        ([(0, 5)], [(0, 1), (3, 4)], [2, 2, 1, 2, 2, 1]),
        # the outer's last saved tensor is the input of (3, 5): its recompute stops before block 3
        ([(0, 5)], [(0, 2), (3, 5)], [2, 2, 2, 1, 1, 1]),
        # three levels: (0, 4) recomputes 0..4 with (1, 3) a region, which recomputes 1..3 with (2, 2)
        ([(0, 5)], [(0, 4), (1, 3), (2, 2)], [2, 3, 4, 3, 2, 1]),
        # shared first block: (0, 3) opens inside (0, 5); its recompute runs 0..3, the outer's 0 and 4, 5
        ([(0, 5)], [(0, 3)], [2, 2, 2, 2, 1, 1]),
        # a plain segment runs once more; with no inner segment, nothing changes
        ([(0, 5)], [], [1, 1, 1, 1, 1, 1]),
    ],
    ids=["inner_inside", "inner_last", "depth_three", "shared_first", "flat"],
)
def test_each_block_runs_as_often_as_the_nested_schedule_says(segments, inner, expected):
    forward, backward = backward_calls(segments, inner)
    assert forward == [1] * 6
    assert backward == expected


class AddmmCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.addmm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


KEEP = [("aten.addmm.default", 0), ("aten.gelu.default", 0), ("aten.bernoulli_.float", 0)]


@pytest.mark.parametrize(
    "segments, inner, keep_ops",
    [
        ([(0, 3)], [(1, 1)], {1: KEEP}),
        ([(0, 7)], [(0, 3), (1, 1), (5, 5)], {1: KEEP[:1], 5: KEEP[2:]}),
        ([(0, 3), (4, 4)], [(2, 2)], {2: KEEP, 4: KEEP[:2]}),
    ],
    ids=["inner_keeps_all", "depth_three_matmul_and_draw", "inner_and_top_level"],
)
def test_inner_one_block_segment_keeps_op_calls_bit_identically(segments, inner, keep_ops):
    ref = train()
    run = train(segments, inner, keep_ops)
    assert_same_training(ref, run)
    assert run[1].keep_ops == {k: frozenset(v) for k, v in keep_ops.items()}


def test_kept_matmul_of_an_inner_block_is_not_run_in_its_recompute():
    def recomputed_addmms(keep_ops):
        torch.manual_seed(0)
        model = Chain(4)
        apply_segments(list(model.blocks), [(0, 3)], inner_segments=[(1, 1)], keep_ops=keep_ops)
        x, y = batches(1)[0]
        loss = nn.functional.cross_entropy(model(x), y)
        with AddmmCounter() as counter:
            loss.backward()
        return counter.count

    # the outer recompute runs the 4 blocks' matmuls; block 1's own recompute one more unless kept
    assert recomputed_addmms(None) == 5
    assert recomputed_addmms({1: KEEP[:1]}) == 4


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_statistics_bit_identical_at_every_level(momentum):
    def run(segments=None, inner=()):
        torch.manual_seed(0)
        model = TinyCNN(n_blocks=5, momentum=momentum)
        if segments:
            apply_segments(list(model.blocks), segments, inner_segments=inner)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(3)]
        losses, grads = train_steps(model, data, 3)
        return model, losses, grads

    ref, ref_losses, ref_grads = run()
    model, losses, grads = run([(0, 4)], [(0, 2), (1, 2), (3, 4)])
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(ref_grads[n], grads[n]) for n in ref_grads)
    buffers = dict(model.named_buffers())
    for name, buf in ref.named_buffers():
        assert torch.equal(buf, buffers[name]), name
    assert int(buffers["blocks.1.bn.num_batches_tracked"]) == 3


def backward_peak(segments, inner):
    torch.manual_seed(0)
    model = Chain(8, d=64, p=0.0)  # a wide batch: activations, not weight gradients, make the peak
    apply_segments(list(model.blocks), segments, inner_segments=inner)
    x = torch.randn(1024, 64)
    with LiveBytesTracker() as tracker:
        loss = model(x).square().sum()
        tracker.reset_peak()
        loss.backward()
    return tracker.peak_bytes


def test_nested_plan_lowers_the_backward_peak():
    flat = backward_peak([(0, 7)], [])
    two_levels = backward_peak([(0, 7)], [(0, 3), (4, 7)])
    three_levels = backward_peak([(0, 7)], [(0, 3), (0, 1), (4, 7), (4, 5)])
    activation = 1024 * 64 * 4  # one block output in fp32; a block saves two such tensors
    # the flat recompute holds the saved tensors of 8 blocks at once; two levels those of 4 blocks
    # and 2 inputs, three levels those of 2 blocks and 4 inputs
    assert two_levels <= flat - 6 * activation
    assert three_levels <= two_levels - 2 * activation


def test_parent_hooks_open_first_and_close_last_on_shared_blocks():
    torch.manual_seed(0)
    model = Chain(8)
    handle = apply_segments(list(model.blocks), [(0, 7)], inner_segments=[(4, 7), (0, 3), (0, 1), (6, 7)])
    seen: list[tuple[str, int, tuple[int, int]]] = []
    for seg in handle._segments:  # record the order in which the plan's hooks hand each call to its segments
        enter, leave = seg.enter, seg.leave
        seg.enter = lambda k, *a, _s=seg, _f=enter: (seen.append(("in", _s.first_index + k, _s.span)), _f(k, *a))[1]
        seg.leave = lambda k, out, _s=seg, _f=leave: (seen.append(("out", _s.first_index + k, _s.span)), _f(k, out))[1]
    out = model(batches(1)[0][0])
    forward = list(seen)  # the recomputes in the backward hand calls on again, each in its own order
    out.sum().backward()
    assert len(seen) > len(forward)

    def spans(way, block):
        return [span for w, b, span in forward if w == way and b == block]

    assert spans("in", 0) == [(0, 7), (0, 3), (0, 1)]
    assert spans("out", 7) == [(6, 7), (4, 7), (0, 7)]
    assert spans("out", 1) == [(0, 1), (0, 3), (0, 7)]
    # one pre-hook and one forward hook per block, whatever the number of segments holding it
    assert len(model.blocks[0]._forward_pre_hooks) == 1 and len(model.blocks[7]._forward_hooks) == 1


def test_remove_detaches_every_level_and_state_dict_keys_stay():
    torch.manual_seed(0)
    model = Chain(8)
    plain = copy.deepcopy(model)
    keys = list(model.state_dict().keys())
    names = [n for n, _ in model.named_modules()]
    handle = apply_segments(list(model.blocks), [(0, 7)], inner_segments=[(5, 6), (0, 3), (1, 2)])
    assert handle.inner_segments == [(0, 3), (1, 2), (5, 6)] and handle.active
    assert list(model.state_dict().keys()) == keys and [n for n, _ in model.named_modules()] == names
    assert len(model.blocks[1]._forward_pre_hooks) == 1  # the plan's one hook hands the call to 3 segments
    handle.remove()
    assert not handle.active and handle.inner_segments == [] and handle.segments == []
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in model.blocks)
    assert list(model.state_dict().keys()) == keys
    x, _ = batches(1)[0]
    torch.manual_seed(4)
    out = model(x)
    torch.manual_seed(4)
    assert torch.equal(out, plain(x))


def test_deepcopy_of_a_nested_plan_trains_bit_identically():
    ref = train()
    torch.manual_seed(0)
    model = Chain(8)
    apply_segments(list(model.blocks), [(0, 7)], inner_segments=[(0, 3), (1, 2), (5, 6)])
    clone = copy.deepcopy(model)
    torch.manual_seed(123)
    losses, grads = train_steps(clone, batches(), 3)
    assert_same_training(ref, (clone, None, losses, grads))


@pytest.mark.parametrize(
    "segments, inner, match",
    [
        ([(0, 2)], [(3, 4)], r"inner segment \(3, 4\) lies inside no segment of \[\(0, 2\)\].*must lie inside one"),
        ([(1, 2)], [(0, 3)], r"inner segment \(0, 3\) lies inside no segment"),
        ([(0, 3), (4, 6)], [(2, 5)], r"inner segment \(2, 5\) crosses the segment \(0, 3\): they share blocks 2..3"),
        ([(0, 7)], [(0, 3), (2, 5)], r"inner segment \(2, 5\) crosses the inner segment \(0, 3\).*disjoint"),
        ([(0, 3)], [(0, 3)], r"inner segment \(0, 3\) equals the segment \(0, 3\) around it.*strictly inside"),
        ([(0, 5)], [(1, 2), (1, 2)], r"inner segment \(1, 2\) equals the inner segment \(1, 2\)"),
        ([(0, 7)], [(4, 9)], r"inner segment \(4, 9\) is outside the chain of 8 blocks.*<= 7"),
        ([(0, 7)], [(-1, 2)], r"inner segment \(-1, 2\) is outside the chain of 8 blocks"),
        ([(0, 7)], [(3, 2)], r"inner segment \(3, 2\) ends before it starts"),
    ],
    ids=["outside", "around_a_segment", "crosses_segment", "crosses_inner", "equals_parent", "duplicate",
         "past_the_end", "negative", "reversed"],
)
def test_invalid_inner_segments_raise_clear_errors(segments, inner, match):
    model = Chain(8)
    with pytest.raises(ValueError, match=match):
        apply_segments(list(model.blocks), segments, inner_segments=inner)
    assert all(not b._forward_pre_hooks for b in model.blocks)  # nothing attached


def test_keep_ops_must_name_a_one_block_segment_at_some_level():
    model = Chain(8)
    with pytest.raises(ValueError, match=r"names block 1, which is inside the segment \(0, 1\)"):
        apply_segments(list(model.blocks), [(0, 7)], inner_segments=[(0, 3), (0, 1)], keep_ops={1: KEEP})
    handle = apply_segments(list(model.blocks), [(0, 7)], inner_segments=[(0, 3), (1, 1)], keep_ops={1: KEEP})
    assert handle.keep_ops == {1: frozenset(KEEP)}


def test_apply_plan_applies_segments_inner_segments_and_keeps():
    from lightning_ckpt.apply.segments import apply_plan
    from lightning_ckpt.costs.block_costs import BlockCost, StepCost
    from lightning_ckpt.planning.policies import make_plan

    cost = StepCost(blocks=tuple(BlockCost(f"b{i}", 10, 1, output_bytes=1, fwd_flops=1) for i in range(4)), batch_size=1)
    plan = make_plan(cost, "manual", segments=[(0, 3)], inner_segments=[(1, 2)])
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    handle = apply_plan(list(model), plan)
    assert handle.segments == [(0, 3)] and handle.inner_segments == [(1, 2)]
    handle.remove()
    with pytest.raises(ValueError, match=r"plan was made for a chain of 4 blocks, but 3 blocks were given"):
        apply_plan(list(model)[:3], plan)
