"""Timings of the profiled blocks turned into costs: savings beyond noise and fitted costs per call."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.op_options import block_options, kept_value, op_value, option_items
from lightning_ckpt.planning.timing_fit import (
    MIN_SHARE,
    BlockTiming,
    fit_keep_ops_op_s,
    fit_op_call_s,
    saving_undecided,
    trusted_saving,
    with_block_timings,
)


def test_with_block_timings_keeps_what_lies_beyond_the_noise_and_scales_to_the_batch():
    cost = StepCost(blocks=(BlockCost("a", 10, 1), BlockCost("b", 10, 1), BlockCost("c", 10, 1)), batch_size=2)
    timings = {
        1: BlockTiming(all_ms=6.0, draws_ms=1.0, noise_ms=2.0),  # draws within the noise: nothing
        2: BlockTiming(all_ms=-4.0, draws_ms=None, noise_ms=1.0),  # keeping lost time: kept negative
    }
    got = with_block_timings(cost, timings, measured_batch=8)
    assert got.blocks[0] == cost.blocks[0]
    assert got.blocks[1].keep_saved_ms == 1.0 and got.blocks[1].keep_draws_saved_ms == 0.0
    assert got.blocks[2].keep_saved_ms == -1.0 and got.blocks[2].keep_draws_saved_ms is None
    recompute_only = with_block_timings(cost, {0: BlockTiming(None, None, recompute_ms=3.0)}, 2)
    assert recompute_only.blocks == cost.blocks
    # beyond the noise but a small share of what recomputing the block costs: none either
    small = BlockTiming(all_ms=1.5, draws_ms=1.5, noise_ms=0.5, recompute_ms=2.0 / MIN_SHARE)
    assert with_block_timings(cost, {1: small}, 2).blocks[1].keep_saved_ms == 0.0
    enough = dataclasses.replace(small, recompute_ms=1.0 / MIN_SHARE)
    assert with_block_timings(cost, {1: enough}, 2).blocks[1].keep_saved_ms == pytest.approx(1.0)
    with pytest.raises(ValueError, match="measured_batch=0 must be a positive batch size"):
        with_block_timings(cost, {}, measured_batch=0)


@pytest.mark.parametrize(
    ("saved", "noise", "recompute", "trusted", "undecided"),
    [
        (7.5, 1.0, 30.0, 6.5, False),  # the band clears the bar (1.5 ms): its lower end counts
        (7.5, 6.6, 30.0, 0.0, True),  # clears its noise, not the bar: more rounds may tell
        (7.0, 6.4, 28.0, 0.0, True),  # the 48-block encoder on a loaded machine
        (1.0, 0.2, 30.0, 0.0, False),  # steady but below the bar: none, whatever more rounds bring
        (0.0, 0.0, 30.0, 0.0, False),
        (-2.0, 1.0, 30.0, -2.0, False),  # a loss counts as measured
        (-0.5, 1.0, 30.0, -0.5, False),  # the band wholly below the bar
        (-0.5, 1.0, None, -0.5, True),
        (0.5, 1.0, None, 0.0, True),  # no recompute measured: the bar is 0
        (1.5, 1.0, None, 0.5, False),
    ],
)
def test_a_saving_counts_beyond_its_noise_and_the_bar_and_is_undecided_while_its_band_holds_the_bar(
    saved, noise, recompute, trusted, undecided
):
    assert trusted_saving(saved, noise, recompute) == pytest.approx(trusted)
    assert saving_undecided(saved, noise, recompute) is undecided
    if not undecided:  # decided means the band lies on one side of the bar: its verdict cannot flip
        assert (trusted_saving(saved, noise, recompute) > 0) == (saved - noise > MIN_SHARE * (recompute or 0.0))


def _called(n: int, tail: int = 0) -> tuple[OpCost, ...]:
    return tuple(OpCost("aten.gelu.default", j, 4, True, True, in_tail=j >= n - tail, mem_bytes=1000) for j in range(n))


def test_fit_op_call_s_is_least_squares_over_the_measured_blocks():
    rates = MachineRates(flop_per_s=1e9, mem_byte_per_s=1e6, rng_byte_per_s=1e6, segment_s=1e-4, op_call_s=5e-3)
    # work 10 ms per block (10 calls of 1000 bytes at 1e6 B/s) of which the tail's 2 calls are skipped
    a = BlockCost("a", 10, 1, fwd_mem_bytes=10_000, tail_mem_bytes=2000, ops=_called(10, tail=2))
    b = BlockCost("b", 10, 1, fwd_mem_bytes=4000, ops=_called(4))
    cost = StepCost(blocks=(a, a, b), batch_size=4)
    # measured: a's 8 calls add 8 x 0.5 ms, b's 4 calls 4 x 0.25 ms (each on top of work and one segment)
    timings = {0: BlockTiming(None, None, recompute_ms=8.0 + 0.1 + 4.0), 2: BlockTiming(None, None, recompute_ms=4.0 + 0.1 + 1.0)}
    timings[1] = timings[0]
    got = fit_op_call_s(cost, timings, rates)
    expected = (2 * 8 * 4.0 + 4 * 1.0) / (2 * 64 + 16) * 1e-3
    assert got == pytest.approx(expected)
    # an estimate already above the measurement: no negative cost per call
    assert fit_op_call_s(cost, {2: BlockTiming(None, None, recompute_ms=1.0)}, rates) == 0.0
    assert fit_op_call_s(cost, {2: BlockTiming(1.0, None)}, rates) is None
    assert fit_op_call_s(StepCost(blocks=(BlockCost("x", 1, 1),), batch_size=1), {0: timings[0]}, rates) is None


def test_the_selective_modes_cost_is_fitted_to_a_lighter_choice_and_prices_it_right():
    """A block where keeping everything saves 3.1 ms but keeping one conv alone loses 0.94 ms
    (measured on the CNN's layer2.0 here): with the fitted fixed cost the option of that conv
    alone is worth nothing (it is dropped), and keeping everything is still worth something, at
    most the 3.1 ms measured (a measurement never raises an estimate)."""
    conv = [OpCost("aten.convolution.default", j, 2**20, True, True, flops=3 * 10**8) for j in range(2)]
    relu = [OpCost("aten.relu.default", j, 2**20, True, True, mem_bytes=2**20) for j in range(2)]
    views = [OpCost("aten.view.default", j, 0, False, False) for j in range(10)]
    blk = BlockCost("layer", saved_bytes=5 * 2**20, input_bytes=2**18, fwd_flops=6 * 10**8, fwd_mem_bytes=2**21,
                    ops=(conv[0], relu[0], conv[1], relu[1], *views))
    rates = MachineRates(flop_per_s=1e11, mem_byte_per_s=1e10, rng_byte_per_s=1e9, keep_ops_op_s=1e-6)
    part = (conv[1].key,)
    timing = BlockTiming(all_ms=3.1, draws_ms=None, part_keys=part, part_ms=-0.94)
    cost = StepCost(blocks=(blk,), batch_size=8)
    fitted = fit_keep_ops_op_s(cost, {0: timing}, rates)
    v_all = sum(op_value(o, blk, "time", rates) for o in option_items(blk))
    v_part = op_value(conv[1], blk, "time", rates)
    fixed_ms = (3.1 * v_part + 0.94 * v_all) / (3.1 + 0.94)
    assert fitted == pytest.approx(fixed_ms / len(blk.ops) * 1e-3)
    priced = dataclasses.replace(rates, keep_ops_op_s=fitted)
    measured = with_block_timings(cost, {0: timing}, 8).blocks[0]
    assert kept_value(measured, part, "time", priced) <= 0
    assert 0 < kept_value(measured, [o.key for o in option_items(blk)], "time", priced) <= 3.1
    def one_conv(options) -> bool:
        return any(len(o.keys) == 1 and o.keys[0][0] == "aten.convolution.default" for o in options)

    assert not one_conv(block_options(measured, "time", priced))
    # with the microbenchmark's cost alone a conv alone looked worth keeping
    assert one_conv(block_options(measured, "time", rates))


def test_the_fit_leaves_out_savings_that_do_not_tell_the_cost_apart():
    blk = BlockCost("b", 10, 1, ops=(OpCost("aten.mm.default", 0, 4, True, True, flops=10**6),))
    rates = MachineRates(flop_per_s=1e9, mem_byte_per_s=1e9, rng_byte_per_s=1e9)
    cost = StepCost(blocks=(blk,), batch_size=1)
    for timing in (BlockTiming(1.0, None), BlockTiming(1.0, None, part_keys=blk.ops[0:1], part_ms=2.0),
                   BlockTiming(None, None, recompute_ms=1.0)):
        assert fit_keep_ops_op_s(cost, {0: timing}, rates) is None
