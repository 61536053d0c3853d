"""Blocks are calls: the chain of calls a step makes, hooks that tell each call its entry, plans applied
per call (a layer shared by every depth, one encoder on two views), and HF ALBERT end to end."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models import steps_with_peaks

from lightning_ckpt import auto_checkpoint
from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.profiling.structure.block_calls import CallSites, TooManyCalls, call_chain, call_names, hook_calls, occurrences
from lightning_ckpt.profiling.passes.profiler import probe_step


class Layer(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class Shared(nn.Module):
    """One layer module run `depth` times per forward (ALBERT, universal transformers)."""

    def __init__(self, depth: int = 5, d: int = 16) -> None:
        super().__init__()
        self.inp, self.layer, self.out, self.depth = nn.Linear(d, d), Layer(d), nn.Linear(d, 1), depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.depth):
            h = self.layer(h)
        return self.out(h).mean()


class TwoViews(nn.Module):
    """One encoder of 3 blocks run on two views; a no-grad pass of its first block as a target."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Layer(d) for _ in range(3))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.blocks[0](x)  # not an entry: it saves nothing
        a, b = self.encode(x), self.encode(x.flip(0))
        return (a * b).mean() + (a - target).square().mean()


def test_names_and_occurrences_of_repeated_modules():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert occurrences([a, b, a, a]) == [0, 0, 1, 2]
    assert call_names(["x", "y", "x", "x"], [a, b, a, a]) == ["x#0", "y", "x#1", "x#2"]


def test_call_sites_count_grad_calls_and_wrap_or_refuse_past_the_last():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    sites = CallSites([a, b, a], names=["a#0", "b", "a#1"])
    assert [sites.next_call(a), sites.next_call(b), sites.next_call(a)] == [0, 1, 2]
    with torch.no_grad():
        assert sites.next_call(a) is None  # a call without grad is no entry and is not counted
    with pytest.raises(TooManyCalls, match=r"block 'a' ran a 3rd time with grad enabled in one step, but the plan's "
                                           r"chain has 2 call\(s\) of it per step"):
        sites.next_call(a, strict=True)
    assert sites.next_call(a) == 0  # not strict: the next step
    sites.cursor = 2  # a recompute names the entry it repeats
    assert sites.next_call(a) == 2 and sites.cursor is None
    everything = CallSites([a, a], grad_only=False)
    with torch.no_grad():
        assert [everything.next_call(a), everything.next_call(a)] == [0, 1]


def test_hook_calls_hand_each_call_its_entry():
    model = Shared(depth=3)
    seen = []
    handles = hook_calls(CallSites([model.layer] * 3), lambda k, m, args: seen.append(("in", k)),
                         lambda k, m, args, out: seen.append(("out", k)))
    model(torch.randn(2, 16))
    for h in handles:
        h.remove()
    assert seen == [("in", 0), ("out", 0), ("in", 1), ("out", 1), ("in", 2), ("out", 2)]


def test_call_chain_reads_calls_in_order_and_leaves_no_grad_calls_out():
    model = TwoViews()
    x = torch.randn(4, 16)
    names = [f"blocks.{i}" for i in range(3)]
    order, got = call_chain(model, list(model.blocks), names, model, x)
    assert got == ["blocks.0#0", "blocks.1#0", "blocks.2#0", "blocks.0#1", "blocks.1#1", "blocks.2#1"]
    assert order == [*model.blocks, *model.blocks]
    shared = Shared(depth=4)
    order, got = call_chain(shared, [shared.layer], ["layer"], shared, x)
    assert got == [f"layer#{k}" for k in range(4)] and all(m is shared.layer for m in order)
    with pytest.raises(ValueError, match=r"blocks \['out'\] never ran with grad enabled"):
        call_chain(shared, [shared.out], ["out"], lambda b: shared.inp(b).sum(), x)


def test_probe_measures_each_call_and_counts_shared_gradients_once():
    model = Shared(depth=4)
    blocks = [model.layer] * 4
    cost = probe_step(model, blocks, model, torch.randn(8, 16), [f"layer#{k}" for k in range(4)], timing=False)
    assert len(cost.blocks) == 4 and all(b.saved_bytes > 0 for b in cost.blocks)
    assert len({b.fwd_flops for b in cost.blocks}) == 1  # the same work at every depth
    layer_grads = sum(p.numel() * 4 for p in model.layer.parameters())
    # the shared layer's gradients appear once: autograd sums the four calls' contributions (alive meanwhile,
    # as the backward's own tensors) and writes .grad in the backward of the first call, which runs last
    assert [b.grad_bytes for b in cost.blocks] == [layer_grads, 0, 0, 0]
    with pytest.raises(TooManyCalls, match="ran a 5th time"):
        probe_step(model, [model.layer] * 4, lambda b: model(b) + model(b), torch.randn(8, 16), None, timing=False)


@pytest.mark.parametrize("segments", [[(1, 2)], [(0, 0), (3, 4)], [(0, 4)]])
def test_plans_over_calls_of_one_module_are_bit_identical(segments):
    torch.manual_seed(0)
    plain = Shared(depth=5)
    model = copy.deepcopy(plain)
    x = torch.randn(8, 16)
    torch.manual_seed(1)
    plain(x).backward()
    handle = apply_segments([model.layer] * 5, segments)
    runs = []
    model.layer.fc1.register_forward_hook(lambda m, a, o: runs.append(torch.is_grad_enabled()))
    torch.manual_seed(1)
    loss = model(x)
    forward_runs = len(runs)
    loss.backward()
    handle.remove()
    assert forward_runs == 5
    assert len(runs) - forward_runs == sum(b - a + 1 for a, b in segments)  # only the planned calls run again
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert not model.layer._forward_pre_hooks and not model.layer._forward_hooks


def test_applied_plan_counts_calls_per_step_and_reports_other_counts():
    model = Shared(depth=3)
    handle = apply_segments([model.layer] * 3, [(0, 1)])
    x = torch.randn(4, 16)
    model(x).backward()
    assert handle.new_step() == {}  # the step called the layer 3 times, as planned
    model.depth = 2
    model(x).backward()
    assert handle.new_step() == {model.layer: (2, 3)}
    handle.remove()


def _tiny_albert(depth: int = 6):
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    config = AlbertConfig(vocab_size=96, embedding_size=16, hidden_size=32, num_hidden_layers=depth,
                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
    return AlbertForMaskedLM(config)


def _albert_batch(n: int, seed: int) -> dict:
    ids = torch.randint(2, 96, (n, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def test_albert_trains_within_budget_bit_identical_with_some_layer_calls_checkpointed():
    """HF ALBERT runs one layer module at every depth (6 calls per step): with blocks=None each call is a block."""
    batches = [_albert_batch(8, seed) for seed in range(3)]

    def loss(model):
        return lambda batch: model(**batch).loss

    plain = _tiny_albert().train()
    reference, plain_peaks = steps_with_peaks(plain, loss(plain), batches)
    model = _tiny_albert().train()
    budget = int(0.85 * max(plain_peaks))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with auto_checkpoint(model, budget, example_batch=batches[0], step_fn=lambda b: model(**b).loss, optimizer=opt,
                         blocks=None, verbose=False, info=lambda m: None, cost_metric="flops") as handle:
        losses, peaks = steps_with_peaks(model, loss(model), batches, handle, opt)
        plan = handle.plan
    names = [r.name for r in plan.rows]
    # blocks=None finds the one layer group module, called once per depth
    assert names == [f"albert.encoder.albert_layer_groups.0#{k}" for k in range(6)]
    assert 0 < len(plan.checkpointed) < 6
    assert max(peaks) <= budget
    assert abs(plan.predicted_peak_bytes - max(peaks)) <= 0.03 * max(peaks)
    assert all(torch.equal(a, b) for a, b in zip(losses, reference))


def test_a_step_with_other_block_calls_than_planned_is_said_with_the_counts():
    model = Shared(depth=4)
    x = torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with auto_checkpoint(model, "1GiB", example_batch=x, step_fn=model, optimizer=opt, blocks=["layer"], policy="full",
                         verbose=False, info=lambda m: None) as handle:
        assert handle.block_names == [f"layer#{k}" for k in range(4)]
        model(x).backward()
        handle.step(x)  # the step before called the layer 4 times, as planned: nothing to say
        model.depth = 3
        model(x).backward()
        with pytest.warns(UserWarning, match=r"the last step called 'layer' 3 times \(planned 4\) with grad enabled"):
            handle.step(x)


class MaskedBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * mask


def test_a_segment_keeps_no_extra_argument_past_the_step():
    """The mask every block of a segment gets is held for the recompute, and let go when the step ends."""
    import gc
    import weakref

    blocks = nn.ModuleList(MaskedBlock() for _ in range(3))
    handle = apply_segments(list(blocks), [(0, 2)])
    x, mask = torch.randn(4, 16, requires_grad=True), torch.ones(4, 16)
    seen = weakref.ref(mask)
    h = x
    for b in blocks:
        h = b(h, mask)
    h.sum().backward()
    del h, mask
    gc.collect()
    assert seen() is None
    handle.remove()
