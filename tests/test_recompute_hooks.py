"""A recompute replays the block call as the caller made it: every other hook on a checkpointed block
(a user's, pruning's, weight norm's) takes effect once, as in the forward. Training with a plan is
bit-identical to training without one: losses, parameters and buffers."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from lightning_ckpt import apply_plan, apply_segments, make_plan, profile_model, static_memory
from lightning_ckpt.engine.target_plan import cost_at

WIDTH = 16


class LinearGelu(nn.Linear):
    """A block that is itself the module holding `weight` (pruning and weight norm act on it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(super().forward(x))


class KwBlock(nn.Module):
    """A block taking a keyword argument, with a BatchNorm (buffers) and dropout (random draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.drop(nn.functional.gelu(self.norm(self.lin(x)) * scale))


class KwChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(KwBlock() for _ in range(6))
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x, scale=self.scale)
        return x


def _sequential():
    model = nn.Sequential(*(LinearGelu(WIDTH, WIDTH) for _ in range(6)))
    return model, list(model)


def _kw_chain():
    model = KwChain()
    return model, list(model.blocks)


def _train(build, hooks=None, segments=None, inner=(), keep_ops=None, late=None, steps=3, early_stop=True):
    """Train `steps` AdamW steps from one seed, `hooks` registered before the plan is applied and
    `late` after; -> (losses, parameters, buffers), all by value."""
    torch.manual_seed(0)
    model, blocks = build()
    if hooks is not None:
        hooks(blocks)
    handle = None
    if segments:
        handle = apply_segments(blocks, segments, early_stop=early_stop, inner_segments=inner, keep_ops=keep_ops)
    if late is not None:
        late(blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(2)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, WIDTH, generator=gen)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    if handle is not None:
        handle.remove()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return losses, params, buffers


def _assert_identical(build, hooks, segments, inner=(), keep_ops=None, late=None, early_stop=True):
    ref = _train(build, hooks, late=late)
    got = _train(build, hooks, segments, inner, keep_ops, late, early_stop=early_stop)
    assert len(ref[0]) == len(got[0])
    for a, b in zip(ref[0], got[0]):
        assert torch.equal(a, b), (a, b)
    for want, have in zip(ref[1:], got[1:]):
        assert want.keys() == have.keys()
        for name in want:
            assert torch.equal(want[name], have[name]), name


def _halve_input(module, args):
    return (args[0] * 0.5,)


def _shift_output(module, args, output):
    return output * 0.5 + 0.25


def _on(indices, register):
    def hooks(blocks):
        for i in indices:
            register(blocks[i])

    return hooks


@pytest.mark.parametrize("block", [0, 1], ids=["first", "middle"])
def test_input_transforming_pre_hook_applies_once(block):
    hooks = _on([block], lambda b: b.register_forward_pre_hook(_halve_input))
    _assert_identical(_sequential, hooks, [(0, 2), (3, 5)])


@pytest.mark.parametrize("block", [1, 2], ids=["middle", "last"])
def test_output_replacing_forward_hook_in_multi_block_segment(block):
    hooks = _on([block], lambda b: b.register_forward_hook(_shift_output))
    _assert_identical(_sequential, hooks, [(0, 2), (3, 5)])


def test_forward_hook_saving_tensors_on_last_block_without_early_stop():
    # the recompute runs the whole last block call, the hook's ops included: they are in the region both times
    hooks = _on([2, 5], lambda b: b.register_forward_hook(lambda m, a, out: out * out))
    _assert_identical(_sequential, hooks, [(0, 2), (3, 5)], early_stop=False)


def test_hooks_under_nested_plan():
    def hooks(blocks):
        blocks[0].register_forward_pre_hook(_halve_input)
        blocks[3].register_forward_pre_hook(_halve_input)  # first block of an inner segment
        for i in (1, 2, 5):  # a middle block, the last of an inner segment, the last of both
            blocks[i].register_forward_hook(_shift_output)

    _assert_identical(_sequential, hooks, [(0, 5)], inner=[(1, 2), (3, 5)])


def test_pre_hook_on_block_keeping_op_calls():
    hooks = _on([1], lambda b: b.register_forward_pre_hook(_halve_input))
    _assert_identical(_sequential, hooks, [(0, 0), (1, 1)], keep_ops={1: [("aten.addmm.default", 0)]})


def test_hooks_with_keyword_arguments():
    def pre(module, args, kwargs):
        return (args[0] * 0.5,), {**kwargs, "scale": kwargs["scale"] * 2}

    def post(module, args, kwargs, output):
        return output + kwargs["scale"]

    def hooks(blocks):
        for i in (0, 2, 4):
            blocks[i].register_forward_pre_hook(pre, with_kwargs=True)
        for i in (1, 2, 5):
            blocks[i].register_forward_hook(post, with_kwargs=True)

    _assert_identical(_kw_chain, hooks, [(0, 2), (3, 5)])


def test_hooks_on_submodules_of_blocks():
    def hooks(blocks):
        for blk in blocks:
            blk.lin.register_forward_pre_hook(_halve_input)
            blk.norm.register_forward_hook(_shift_output)

    _assert_identical(_kw_chain, hooks, [(0, 2), (3, 5)])


def test_pruning_on_block_modules_themselves():
    def hooks(blocks):
        for i in (0, 1, 4):
            prune.l1_unstructured(blocks[i], "weight", amount=0.3)

    _assert_identical(_sequential, hooks, [(0, 2), (3, 5)])


def test_weight_norm_on_block_modules_themselves():
    def hooks(blocks):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old API, as users still call it
            for i in (0, 2, 3):
                torch.nn.utils.weight_norm(blocks[i])

    _assert_identical(_sequential, hooks, [(0, 2), (3, 5)])


def test_hooks_registered_after_the_plan_run_inside_its_regions():
    def late(blocks):
        blocks[0].register_forward_pre_hook(_halve_input)
        for i in (1, 2):
            blocks[i].register_forward_hook(_shift_output)

    _assert_identical(_sequential, None, [(0, 2), (3, 5)], late=late)
    model, blocks = _sequential()
    apply_segments(blocks, [(0, 2)])
    late(blocks)
    model(torch.randn(4, WIDTH))
    assert [h.__name__ for h in blocks[2]._forward_hooks.values()] == ["_shift_output", "post_hook"]


def test_pre_hook_prepended_after_the_plan_is_reordered_with_a_warning():
    torch.manual_seed(0)
    model, blocks = _sequential()
    handle = apply_segments(blocks, [(0, 2), (3, 5)])
    blocks[0].register_forward_pre_hook(_halve_input, prepend=True)
    x = torch.randn(8, WIDTH)
    with pytest.warns(UserWarning, match="registered on block 0 with prepend=True after the checkpointing plan"):
        (model(x) ** 2).mean().backward()  # this call runs that segment unchecked
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # from the next call on, the segment's hook is in front again
        (model(x) ** 2).mean().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    handle.remove()
    torch.manual_seed(0)
    plain, plain_blocks = _sequential()
    plain_blocks[0].register_forward_pre_hook(_halve_input)
    (plain(x) ** 2).mean().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, plain.parameters()))


def test_profile_with_hooks_plans_multi_block_segments_that_apply():
    def hooks(blocks):
        blocks[1].register_forward_hook(_shift_output)  # the output block 2 receives is the hooked one
        blocks[3].register_forward_pre_hook(_halve_input)  # block 3 still receives block 2's output

    torch.manual_seed(0)
    model, blocks = _sequential()
    hooks(blocks)
    batch = torch.randn(16, WIDTH)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    profile = profile_model(model, blocks, lambda x: (model(x) ** 2).mean(), batch, timing=False)
    cost = cost_at(profile, 16, static_memory(model, [opt]))
    assert all(b.chains_from_previous for b in cost.blocks)
    plan = make_plan(cost, "every_k", every_k=3)
    assert list(plan.segments) == [(0, 2), (3, 5)]

    def train(apply: bool):
        torch.manual_seed(0)
        model, blocks = _sequential()
        hooks(blocks)
        handle = apply_plan(blocks, plan) if apply else None
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        losses = []
        for step in range(3):
            loss = (model(batch + step) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        if handle is not None:
            handle.remove()
        return losses, [p.detach().clone() for p in model.parameters()]

    ref, got = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))


def test_a_recompute_mismatch_names_global_module_hooks_as_a_cause():
    from torch.utils.checkpoint import CheckpointError

    from lightning_ckpt.apply.recompute_errors import explain_checkpoint_error

    err = CheckpointError("torch.utils.checkpoint: A different number of tensors was saved during the original forward")
    with pytest.raises(CheckpointError, match=r"(?s)global module hook.*register_module_forward_pre_hook.*inside it"):
        raise explain_checkpoint_error(err)
