"""Profiler: linear extrapolation of bytes, state left untouched (`state`), batch slicing."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import numpy as np
import pytest
import torch
from torch import nn
from models import (
    FedChain,
    IdentityWrap,
    MLPBlock,
    TinyChain,
    TinyCNN,
    tokens_batch,
    wrap_like_zero3,
)

from lightning_ckpt.profiling.structure.batch import batch_size_of, slice_batch
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.profiling.passes.profiler import probe_step
from lightning_ckpt.profiling.forward_state.state import preserved_rng, preserved_state, unchanged_parameters


def _chain_loss(model):
    def step(batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    return step


@pytest.mark.parametrize("probes", [(1, 2), (2, 4)])
def test_bytes_from_two_small_probes_within_2_percent_at_batch_32(probes):
    torch.manual_seed(0)
    model = TinyChain(n_blocks=4, d=64, vocab=100, p=0.1)
    batch = tokens_batch(batch=32, seq=48, vocab=100)
    prof = profile_model(model, list(model.blocks), _chain_loss(model), batch, probes, check_batch_size=8)
    assert prof.check_error() < 0.02
    predicted = prof.at(32)
    measured = probe_step(model, list(model.blocks), _chain_loss(model), batch, timing=False)
    for p, m in zip(predicted.blocks, measured.blocks):
        for field in ("saved_bytes", "input_bytes", "output_bytes", "fwd_flops", "fwd_mem_bytes", "tail_mem_bytes", "fwd_rng_bytes"):
            assert getattr(p, field) == pytest.approx(getattr(m, field), rel=0.02), field
        assert m.saved_bytes > 10 * m.input_bytes  # the block really saves its interior


def test_probe_measures_what_the_block_saves():
    """One Linear->GELU->Linear block: hand-count its saved activations."""
    torch.manual_seed(0)
    model = TinyChain(n_blocks=2, d=16, vocab=20, p=0.0)
    b, s, d = 4, 8, 16
    cost = probe_step(model, list(model.blocks), _chain_loss(model), tokens_batch(batch=b, seq=s, vocab=20), timing=False)
    blk = cost.blocks[1]
    f = 4  # float32
    # LayerNorm saves its input (x), mean and rstd; fc1 saves its input (normed x);
    # GELU saves its input (fc1 out); fc2 saves its input (gelu out).
    expected = f * (b * s * d + 2 * b * s + b * s * d + b * s * 4 * d + b * s * 4 * d)
    assert blk.saved_bytes == expected
    assert blk.input_bytes == f * b * s * d
    assert blk.input_saved_bytes == blk.input_bytes
    # Without saving (inside a checkpoint) each intermediate dies once consumed: the peak
    # is GELU's input and output together, 2 x (b, s, 4d); far below what it would save.
    assert blk.ckpt_fwd_peak_bytes == f * 2 * b * s * 4 * d
    assert blk.fwd_flops == 2 * (2 * b * s * d * 4 * d)
    # bytes written by ops without FLOPs: LayerNorm (out, mean, rstd), GELU and the residual
    # add (dropout with p=0 runs no op); the add follows the last saved tensor
    assert blk.fwd_mem_bytes == f * (b * s * d + 2 * b * s + b * s * 4 * d + b * s * d)
    assert blk.fwd_rng_bytes == 0
    assert blk.tail_mem_bytes == f * b * s * d
    assert blk.grad_bytes == f * (2 * d + 4 * d * d + 4 * d + 4 * d * d + d)
    assert cost.blocks[1].chains_from_previous


def test_blocks_chain_through_identity_functions_like_zero3():
    """DeepSpeed ZeRO-3 wraps every module's inputs and outputs in identity autograd Functions,
    so no block receives the previous block's output object; the blocks still chain."""
    torch.manual_seed(0)
    model = TinyChain(n_blocks=3, d=16, vocab=20, p=0.1)
    wrap_like_zero3(model)
    batch = tokens_batch(batch=2, seq=6, vocab=20)
    cost = probe_step(model, list(model.blocks), _chain_loss(model), batch, timing=False)
    assert [b.chains_from_previous for b in cost.blocks] == [True, True, True]


FEEDS = {  # what the forward passes from one block to the next, and whether that chains
    "itself": (lambda x: x, True),
    "identity_function": (IdentityWrap.apply, True),
    "two_identity_functions": (lambda x: IdentityWrap.apply(IdentityWrap.apply(x)), True),
    "clone": (lambda x: x.clone(), False),
    "plus_zero": (lambda x: x + 0, False),
    "detached": (lambda x: x.detach(), False),  # same storage, but no longer requires grad
    "clone_in_identity_function": (lambda x: IdentityWrap.apply(x.clone()), False),
    "written_in_place": (lambda x: x.mul_(2), False),  # the same object, but not the values the block returned
    "alias_written_in_place": (lambda x: IdentityWrap.apply(x).mul_(2), False),
}


@pytest.mark.parametrize("feed", FEEDS)
def test_chain_check_tells_aliases_from_copies(feed):
    fn, chains = FEEDS[feed]
    torch.manual_seed(0)
    model = FedChain(fn, n_blocks=3, d=16, vocab=20, p=0.0)
    batch = tokens_batch(batch=2, seq=6, vocab=20)
    cost = probe_step(model, list(model.blocks), _chain_loss(model), batch, timing=False)
    assert [b.chains_from_previous for b in cost.blocks] == [True, chains, chains]


def test_profiling_leaves_all_state_as_found():
    torch.manual_seed(0)
    model = TinyCNN(n_blocks=3, c=4)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 3, 8, 8)
    y = torch.randint(0, 2, (8,))

    def step(batch):
        xb, yb = batch
        return torch.nn.functional.cross_entropy(model(torch.nn.functional.dropout(xb, 0.3)), yb)

    step((x, y)).backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt_state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state.items()}
    rng = torch.get_rng_state()
    py_state, np_state = random.getstate(), np.random.get_state()

    profile_model(model, list(model.blocks), step, (x, y), (2, 4), 8)

    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # includes running stats and num_batches_tracked
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    for k, v in opt.state.items():
        for kk, vv in v.items():
            assert torch.equal(vv, opt_state[k][kk])
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py_state
    assert np.array_equal(np.random.get_state()[1], np_state[1])
    assert model.training


def test_slicing_nested_batches():
    batch = {"x": torch.zeros(8, 3), "meta": [torch.ones(8), "tag"], "n": 3}
    assert batch_size_of(batch) == 8
    sliced = slice_batch(batch, 2)
    assert sliced["x"].shape == (2, 3) and sliced["meta"][0].shape == (2,) and sliced["meta"][1] == "tag"
    assert batch_size_of((torch.zeros(8, 2), torch.zeros(3), torch.zeros(8))) == 8  # the [3] is not per-sample
    with pytest.raises(ValueError, match="holds no tensor with a batch dimension"):
        batch_size_of({"s": torch.tensor(1.0)})


def test_bad_probe_sizes_and_small_batch():
    model = TinyChain(n_blocks=2)
    batch = tokens_batch(batch=4)
    with pytest.raises(ValueError, match="two different positive integers"):
        profile_model(model, list(model.blocks), _chain_loss(model), batch, (2, 2))
    with pytest.raises(ValueError, match="the batch has 4 samples but profiling slices up to 8"):
        profile_model(model, list(model.blocks), _chain_loss(model), batch, (1, 2), check_batch_size=8)


def test_step_must_return_a_loss():
    model = TinyChain(n_blocks=2)
    with pytest.raises(ValueError, match="training_step must return the loss"):
        probe_step(model, list(model.blocks), lambda b: model(b[0]), tokens_batch(batch=2))


def test_slices_are_copies_so_boundary_bytes_scale_with_the_batch():
    batch = torch.zeros(8, 5)
    part = slice_batch(batch, 2)
    assert part.untyped_storage().nbytes() == 2 * 5 * 4


# ----------------------------------------------------------------------------- state.py


def _rng_streams():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _same_rng(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


@pytest.mark.parametrize("fails", [False, True])
def test_preserved_rng_puts_every_stream_back(fails):
    before = _rng_streams()
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with preserved_rng():
            torch.rand(3), random.random(), np.random.rand()
            if fails:
                raise RuntimeError("inside")
    assert _same_rng(before, _rng_streams())


@pytest.mark.parametrize("fails", [False, True])
def test_preserved_state_puts_requires_grad_and_grads_back(fails):
    """A step that turns `requires_grad` off (as `toggle_optimizer` does) and dies before turning it
    back: flags and gradients are as before, as are the RNG streams."""
    model = TinyChain(n_blocks=2)
    model.head.weight.requires_grad_(False)
    grads = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n]
    before = _rng_streams()
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with preserved_state(model):
            assert all(p.grad is None for p in model.parameters())
            for p in model.blocks[0].parameters():
                p.requires_grad_(False)
            model.head.weight.requires_grad_(True)
            torch.rand(3)
            if fails:
                raise RuntimeError("inside")
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["head.weight"]
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    assert _same_rng(before, _rng_streams())


def test_unchanged_parameters_reports_in_place_writes_only():
    model = TinyChain(n_blocks=2)
    with unchanged_parameters(model):  # gradients, `.data` swaps and reads are no writes
        model(tokens_batch(batch=2)[0]).sum().backward()
        model.head.bias.data = model.head.bias.data.clone()
    with pytest.raises(RuntimeError, match=r"^the training step modified 2 parameter\(s\) in place during profiling "
                                           r"\(head\.weight, head\.bias\)"):
        with unchanged_parameters(model), torch.no_grad():
            model.head.weight.mul_(1.0)
            model.head.bias.zero_()
    with pytest.raises(KeyError):  # a failure inside is what comes out, not the report
        with unchanged_parameters(model), torch.no_grad():
            model.head.bias.zero_()
            raise KeyError("inside")


# ----------------------------------------------------------------------------- storages carried past the next block


class _SkipChain(torch.nn.Module):
    """Four blocks; block 0's output is also added to the last block's output (a long skip), and an
    MLP the chain does not list runs between blocks 1 and 2."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(MLPBlock(d, 0.1) for _ in range(4))
        self.mid = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        skip = x = self.blocks[0](x)
        x = self.mid(self.blocks[1](x))
        x = self.blocks[3](self.blocks[2](x))
        return (x + skip).mean()


def test_a_long_skip_and_a_module_between_blocks_are_carried():
    torch.manual_seed(0)
    model = _SkipChain()
    x = torch.randn(16, 8, 32)
    cost = probe_step(model, list(model.blocks), lambda b: model(b), x, timing=False)
    act = 16 * 8 * 32 * 4
    first, _, after_mid, last = cost.blocks
    # block 0's output lives to the head: out of its own fields, carried by every later block
    assert first.output_bytes == 0 and cost.blocks[1].input_bytes == 0
    assert all(b.carried_fwd_bytes >= act for b in cost.blocks[1:]) and cost.carried_end_bytes >= act
    # what the MLP saves (its input, both sides of its GELU) is carried from it on; block 2 does not chain
    assert not after_mid.chains_from_previous and cost.blocks[1].chains_from_previous
    assert after_mid.gap_fwd_bytes >= 9 * act and after_mid.carried_fwd_bytes >= act + 9 * act
    assert last.carried_bwd_bytes >= 9 * act
    # the MLP's weights are read last before block 2: their gradients exist from block 2's backward on
    assert after_mid.gap_grad_bytes == sum(p.numel() * 4 for p in model.mid.parameters())
    assert cost.outside_grad_bytes == after_mid.gap_grad_bytes


def test_predicted_whole_step_peaks_of_the_skip_chain_are_exact():
    from lightning_ckpt.apply.segments import apply_segments
    from lightning_ckpt.planning.memory_model import predict_peak
    from lightning_ckpt.profiling.memory.step_peak import measure_step_peak

    from lightning_ckpt.profiling.memory.static_memory import static_memory

    torch.manual_seed(0)
    model = _SkipChain()
    x = torch.randn(16, 8, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss_fn(b):
        return model(b)

    loss_fn(x).backward()  # gradients exist, as in training
    opt.step()
    cost = probe_step(model, list(model.blocks), loss_fn, x, timing=False)
    static = static_memory(model, [opt])
    cost = dataclasses.replace(cost, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes)
    for segs in ([], [(0, 0), (1, 1), (2, 2), (3, 3)], [(0, 1)], [(2, 3)], [(1, 1), (3, 3)]):
        handle = apply_segments(list(model.blocks), segs)
        try:
            measured = measure_step_peak(model, loss_fn, x, opt)
        finally:
            handle.remove()
        predicted = predict_peak(cost, segs).peak_bytes
        assert abs(predicted - measured) <= 0.01 * measured, (segs, predicted, measured)


def test_a_recompute_that_stops_after_the_output_layernorm_holds_the_output():
    """BERT's output sublayer ends in LayerNorm, which saves its mean and rstd after making its output:
    a recompute stops there (torch's early stop) with the output alive beside the dropout's output the
    block still holds; a block ending in an add (`MLPBlock`) makes its output after its last save.
    Segments' whole-step peaks, measured by a tracker of live storages apart from the library's: within
    8 B of the prediction, the loss's 4 B gradient seed the only miss (without the output: 16,260 B under)."""
    from models import PostNormBlock
    from storage_oracle import LiveStorages

    from lightning_ckpt.apply.segments import apply_segments
    from lightning_ckpt.planning.memory_model import predict_peak
    from lightning_ckpt.profiling.memory.static_memory import static_memory

    torch.manual_seed(0)
    model = TinyChain(n_blocks=4, d=16, p=0.1)
    model.blocks = nn.ModuleList(PostNormBlock(16, p=0.1) for _ in range(4))
    batch = tokens_batch(batch=8, seq=32)
    loss_fn = _chain_loss(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn(batch).backward()
    cost = probe_step(model, list(model.blocks), loss_fn, batch, timing=False)
    cost = dataclasses.replace(cost, static_bytes=static_memory(model, [opt]).resident_bytes)
    assert all(b.stop_output_bytes == b.output_bytes > 0 for b in cost.blocks)
    mlp = TinyChain(n_blocks=2, d=16, p=0.1)
    assert probe_step(mlp, list(mlp.blocks), _chain_loss(mlp), batch, timing=False).blocks[1].stop_output_bytes == 0
    for segs in ([(0, 3)], [(1, 2)], [(0, 0), (1, 2)], [(0, 0), (1, 1), (2, 2), (3, 3)]):
        handle = apply_segments(list(model.blocks), segs)
        try:
            opt.zero_grad(set_to_none=True)
            with LiveStorages() as live:
                live.count([*model.parameters(), *batch])
                loss_fn(batch).backward()
        finally:
            handle.remove()
        predicted = predict_peak(cost, segs)
        assert predicted.phase.startswith("backward")
        assert abs(predicted.peak_bytes - live.peak) <= 8, (segs, predicted, live.peak)


class _BiasBlock(torch.nn.Module):
    """Returns (hidden, bias): the first block makes the bias, every later one reads it and passes it
    on (as T5's blocks pass the position bias), so its gradient is complete only at the first block."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, bias=None):
        if bias is None:
            bias = self.lin(x).mean(0)
        return torch.relu(self.lin(x) + bias), bias


def test_gradients_of_module_outputs_are_not_held_by_the_flop_counter():
    """`FlopCounterMode`'s module tracker held each module's output gradients until all its outputs
    had one: with the bias passed through every block, until the first block's backward."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_BiasBlock() for _ in range(4))

    def loss_fn(x):
        bias = None
        for b in blocks:
            x, bias = b(x, bias)
        return x.sum()

    cost = probe_step(blocks, list(blocks), loss_fn, torch.randn(64, 16), timing=False)
    # a block's output gradient is 4 KiB; what is left is the bias's gradient on its way to block 0
    assert all(b.carried_bwd_bytes <= 256 for b in cost.blocks), [b.carried_bwd_bytes for b in cost.blocks]


@pytest.mark.parametrize("sharded", [False, True])
def test_sharded_blocks_run_the_same_passes_whatever_their_bytes(monkeypatch, sharded):
    """Batch 1 is off the line: unsharded, the profiler leaves it out and checks the new line on a
    slice twice the check (and times the promoted check). Sharded blocks gather their parameters in
    every forward, so every rank must run the same passes: the probes and the check only, timed."""
    import lightning_ckpt.profiling.passes.measured_profile as profiler
    from lightning_ckpt.costs.block_costs import BlockCost, StepCost
    from lightning_ckpt.costs.machine_rates import MachineRates

    def fake_probe(model, blocks, step_fn, batch, names=None, timing=True, room_bytes=None, recompute=False):
        b = batch_size_of(batch)
        calls.append((b, timing))
        block = BlockCost("b0", saved_bytes=1000 * b, input_bytes=10 * b, bwd_transient_bytes=300 if b == 1 else 200 * b)
        return StepCost(blocks=(block,), batch_size=b, meta={"work": {"device": "cpu"}})

    calls: list = []
    timed: list = []
    monkeypatch.setattr(profiler, "probe_step", fake_probe)
    monkeypatch.setattr(profiler, "_time_blocks", lambda model, blocks, fn, batch: timed.append(batch_size_of(batch)) or [1.0])
    monkeypatch.setattr(profiler, "sharded_world_size", lambda blocks: 2 if sharded else 1)
    model = nn.Sequential(nn.Linear(4, 4))
    rates = MachineRates(flop_per_s=1e10, mem_byte_per_s=1e9, rng_byte_per_s=1e8)
    profile = profile_model(model, [model[0]], lambda x: model(x).sum(), torch.randn(16, 4), rates=rates, calibrate_keeps=False)
    if sharded:
        assert calls == [(1, True), (2, True), (4, True)] and timed == []
        assert [p.batch_size for p in profile.probes] == [2, 4] and profile.check is None
    else:
        assert calls == [(1, True), (2, True), (4, False), (8, False)] and timed == [4]
        assert [p.batch_size for p in profile.probes] == [2, 4] and profile.check.batch_size == 8
