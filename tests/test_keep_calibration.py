"""Measured savings of keeping op outputs, and how they scale the `time` op-level options."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from models import MLPBlock, TinyChain, tokens_batch
from torch import nn

from lightning_ckpt.planning.costs import BlockCost, OpCost, StepCost
from lightning_ckpt.planning.machine_rates import MachineRates
from lightning_ckpt.planning.op_options import (
    block_options,
    keep_calibration,
    kept_value,
    option_items,
    step_options,
)
from lightning_ckpt.profiling.keep_calibration import (
    BlockCall,
    KeepSavings,
    capture_block_calls,
    measure_keep_savings,
    with_keep_savings,
)
from lightning_ckpt.profiling.profiler import probe_step, profile_model


def _chain_loss(model):
    def loss(batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    return loss


# ----------------------------------------------------------------------------- measuring


class NormDropBlock(nn.Module):
    """Linear, BatchNorm, GELU and dropout: buffers a step changes and draws it makes."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(nn.functional.gelu(self.bn(self.fc(x))))


def _keys(block: nn.Module, x: torch.Tensor) -> tuple[list, list]:
    """(every keepable call, the random ones) of `block`'s forward on `x`, as the profile sees them."""
    chain = nn.Sequential(block)
    cost = probe_step(chain, [block], lambda b: chain(b).square().mean(), x.requires_grad_(False), timing=False)
    items = option_items(cost.blocks[0])
    return [o.key for o in items], [o.key for o in items if o.rng_bytes]


def test_measuring_leaves_rng_buffers_and_grads_as_found():
    torch.manual_seed(0)
    block = NormDropBlock()
    x = torch.randn(32, 16)
    keys, draws = _keys(block, x)
    assert draws and set(draws) < set(keys)
    block(x).sum().backward()  # grads and BatchNorm statistics that are not the initial ones
    block.fc.bias.grad = None
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in block.named_parameters()}
    grad_objects = {n: p.grad for n, p in block.named_parameters()}
    buffers = {n: b.clone() for n, b in block.named_buffers()}
    rng = torch.get_rng_state()

    got = measure_keep_savings(block, BlockCall((x,), {}), keys, draws, rounds=2)

    assert math.isfinite(got.all_ms) and got.draws_ms is not None and math.isfinite(got.draws_ms)
    assert torch.equal(torch.get_rng_state(), rng)
    for n, b in block.named_buffers():
        assert torch.equal(b, buffers[n]), n
    for n, p in block.named_parameters():
        assert p.grad is grad_objects[n], n
        assert (p.grad is None) == (grads[n] is None) and (p.grad is None or torch.equal(p.grad, grads[n])), n
    assert x.grad is None


def test_no_draw_saving_without_draws_and_the_whole_one_when_only_draws_are_kept():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    x = torch.randn(4, 8)
    keys, draws = _keys(block, x)
    assert keys and not draws
    assert measure_keep_savings(block, BlockCall((x,), {}), keys, draws, rounds=1).draws_ms is None
    only_draws = MLPBlock(8, p=0.5)
    keys, draws = _keys(only_draws, torch.randn(4, 8))
    got = measure_keep_savings(only_draws, BlockCall((torch.randn(4, 8),), {}), draws, draws, rounds=1)
    assert got.draws_ms == got.all_ms


def test_measuring_checks_its_keys():
    block = nn.Linear(4, 4)
    call = BlockCall((torch.randn(2, 4),), {})
    with pytest.raises(ValueError, match="all_keys is empty"):
        measure_keep_savings(block, call, [])
    with pytest.raises(ValueError, match="are not in all_keys"):
        measure_keep_savings(block, call, [("aten.addmm.default", 0)], [("aten.bernoulli_.float", 0)])
    with pytest.raises(ValueError, match="rounds=0 must be at least 1"):
        measure_keep_savings(block, call, [("aten.addmm.default", 0)], rounds=0)
    with pytest.raises(ValueError, match="never made"):
        measure_keep_savings(block, call, [("aten.mm.default", 7)], rounds=1)


def test_captured_calls_are_copies_with_their_autocast():
    torch.manual_seed(0)
    model = TinyChain(n_blocks=3, d=8, p=0.1)
    batch = tokens_batch(batch=4, seq=5)
    loss = _chain_loss(model)

    def under_autocast(b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(b)

    calls = capture_block_calls(list(model.blocks), [1], under_autocast, batch)
    assert list(calls) == [1]
    (x,) = calls[1].args
    assert x.shape == (4, 5, 8) and not x.requires_grad
    assert calls[1].autocast == (("cpu", torch.bfloat16),)
    assert capture_block_calls(list(model.blocks), [0], loss, batch)[0].autocast == ()


def test_profile_measures_each_distinct_block_once_on_the_whole_batch_and_scales_with_the_batch():
    torch.manual_seed(0)
    model = TinyChain(n_blocks=3, d=16, p=0.1)
    batch = tokens_batch(batch=8, seq=6)
    profile = profile_model(model, list(model.blocks), _chain_loss(model), batch, (2, 4), 8)
    at8, at4 = profile.at(8), profile.at(4)
    saved = {b.keep_saved_ms for b in at8.blocks}
    draws = {b.keep_draws_saved_ms for b in at8.blocks}
    assert len(saved) == 1 and len(draws) == 1  # the blocks have equal op lists: one measurement
    (s,), (d,) = saved, draws
    assert math.isfinite(s) and math.isfinite(d)
    assert profile.probes[0].meta["keep_calibration_s"] > 0
    # measured at the whole batch (8) and in proportion to the batch at the probes
    assert [b.keep_saved_ms for b in profile.probes[0].blocks] == pytest.approx([s / 4] * 3)
    assert [b.keep_saved_ms for b in at4.blocks] == pytest.approx([s / 2] * 3)
    assert [b.keep_draws_saved_ms for b in at4.blocks] == pytest.approx([d / 2] * 3)
    rates = at8.rates
    opts = step_options(at8, "time", rates)
    expected = [kept_value(at8.blocks[0], o.keys, "time", rates) for o in opts[0]]
    assert [o.value for o in opts[0]] == pytest.approx(expected)


def test_no_calibration_without_timing_or_when_turned_off():
    torch.manual_seed(0)
    model = TinyChain(n_blocks=2, d=8, p=0.1)
    batch = tokens_batch(batch=4, seq=5)
    for kw in ({"timing": False}, {"calibrate_keeps": False}):
        profile = profile_model(model, list(model.blocks), _chain_loss(model), batch, (1, 2), None, **kw)
        assert all(b.keep_saved_ms is None and b.keep_draws_saved_ms is None for b in profile.at(4).blocks)
        assert "keep_calibration_s" not in profile.probes[0].meta


def test_with_keep_savings_scales_to_the_probe_batch_and_skips_unmeasured_blocks():
    cost = StepCost(blocks=(BlockCost("a", 10, 1), BlockCost("b", 10, 1)), batch_size=2)
    got = with_keep_savings(cost, {1: KeepSavings(all_ms=-4.0, draws_ms=8.0)}, measured_batch=8)
    assert got.blocks[0] == cost.blocks[0]
    assert got.blocks[1].keep_saved_ms == -1.0 and got.blocks[1].keep_draws_saved_ms == 2.0
    with pytest.raises(ValueError, match="measured_batch=0 must be a positive batch size"):
        with_keep_savings(cost, {}, measured_batch=0)


# ----------------------------------------------------------------------------- the data


def test_savings_survive_a_json_round_trip_and_may_be_negative():
    block = BlockCost("b", 10, 1, keep_saved_ms=-0.25, keep_draws_saved_ms=1.5)
    cost = StepCost(blocks=(block, BlockCost("c", 10, 1)), batch_size=4)
    back = StepCost.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert back == cost
    assert back.blocks[0].keep_saved_ms == -0.25 and back.blocks[1].keep_draws_saved_ms is None
    with pytest.raises(ValueError, match="fwd_ms=-1.0 is negative"):
        BlockCost("b", 10, 1, fwd_ms=-1.0)


# ----------------------------------------------------------------------------- calibrating the options

RATES = MachineRates(flop_per_s=1e9, mem_byte_per_s=1e9, rng_byte_per_s=1e8, keep_draws_op_s=1e-6, keep_ops_op_s=1e-5)
DRAW = OpCost("aten.bernoulli_.float", 0, keep_bytes=1000, saved=True, keepable=True, rng_bytes=40000)
MM = OpCost("aten.mm.default", 0, keep_bytes=4000, saved=True, keepable=True, flops=10**6)
GELU = OpCost("aten.gelu.default", 0, keep_bytes=2000, saved=True, keepable=True, mem_bytes=2 * 10**5)


def _block(**kw) -> BlockCost:
    return BlockCost("b", saved_bytes=8000, input_bytes=100, fwd_flops=10**6, ops=(DRAW, MM, GELU), **kw)


def _estimate(block: BlockCost, keys) -> float:
    return kept_value(block, keys, "time", RATES)


def test_options_are_scaled_to_the_measured_saving():
    plain = _block()
    every = [o.key for o in option_items(plain)]
    draws = [DRAW.key]
    v_all, v_draws = _estimate(plain, every), _estimate(plain, draws)
    assert v_all > 0 and v_draws > 0
    base = block_options(plain, "time", RATES)
    assert base and any(o.keys == (DRAW.key,) for o in base) and any(len(o.keys) > 1 for o in base)

    # keeping everything saves a quarter of its estimate, the draws alone half of theirs
    measured = _block(keep_saved_ms=v_all / 4, keep_draws_saved_ms=v_draws / 2)
    assert keep_calibration(measured, every, RATES) == pytest.approx(0.25)
    assert keep_calibration(measured, draws, RATES) == pytest.approx(0.5)
    opts = block_options(measured, "time", RATES)
    for o in opts:
        factor = 0.5 if o.keys == (DRAW.key,) else 0.25
        assert o.value == pytest.approx(factor * _estimate(plain, o.keys))
        assert o.value == pytest.approx(kept_value(measured, o.keys, "time", RATES))
    assert max(o.value for o in opts) < max(o.value for o in base)


def test_a_measurement_never_raises_an_estimate():
    plain = _block()
    every = [o.key for o in option_items(plain)]
    faster = _block(keep_saved_ms=10 * _estimate(plain, every), keep_draws_saved_ms=10.0)
    assert block_options(faster, "time", RATES) == block_options(plain, "time", RATES)


@pytest.mark.parametrize("saved_ms", [0.0, -0.5])
def test_a_block_whose_keeping_saves_nothing_has_no_options(saved_ms):
    measured = _block(keep_saved_ms=saved_ms, keep_draws_saved_ms=saved_ms)
    assert block_options(measured, "time", RATES) == ()
    assert kept_value(measured, [MM.key], "time", RATES) == 0.0
    # the draws measured alone still save: only the options that keep draws only are left
    draws_save = _block(keep_saved_ms=saved_ms, keep_draws_saved_ms=1.0)
    assert [o.keys for o in block_options(draws_save, "time", RATES)] == [(DRAW.key,)]
    # the other metrics do not read the measurement
    assert block_options(measured, "flops", None) == block_options(_block(), "flops", None)


def test_blocks_with_equal_ops_but_other_measurements_get_their_own_options():
    plain = _block()
    every = [o.key for o in option_items(plain)]
    low = _block(keep_saved_ms=_estimate(plain, every) / 2)
    cost = StepCost(blocks=(plain, low, _block(keep_saved_ms=-1.0, keep_draws_saved_ms=-1.0)), batch_size=1)
    first, second, third = step_options(cost, "time", RATES)
    assert first == block_options(plain, "time", RATES)
    assert second == block_options(low, "time", RATES) != first
    assert third == ()


def test_an_estimate_that_loses_is_not_raised_by_a_saving_measurement():
    """When the estimate of keeping everything is not positive, the measurement cannot be
    turned into a factor: a positive one leaves the estimates as they are."""
    slow = dataclasses.replace(RATES, keep_ops_op_s=1e-3)
    plain = _block()
    every = [o.key for o in option_items(plain)]
    assert kept_value(plain, every, "time", slow) < 0
    measured = _block(keep_saved_ms=1.0, keep_draws_saved_ms=None)
    assert keep_calibration(measured, every, slow) == 1.0
    assert block_options(measured, "time", slow) == block_options(plain, "time", slow)
