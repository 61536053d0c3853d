"""Recompute cost in the `time` metric: the fixed cost of each recomputed op call, and under sharding
a block's all-gather at the measured rate."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.recompute_cost import (
    block_recompute,
    op_calls,
    recompute_cost,
    segment_cost,
    skipped_tail,
)

RATES = MachineRates(flop_per_s=3e9, mem_byte_per_s=7e9, rng_byte_per_s=1e9, segment_s=2e-5)
GATHER_RATES = dataclasses.replace(RATES, gather_byte_per_s=4e8)  # 0.4 GB/s, the order of two CPU ranks


def _block(gather_bytes: int = 0) -> BlockCost:
    return BlockCost("b", saved_bytes=1000, input_bytes=100, fwd_flops=10**7, tail_flops=4 * 10**6,
                     fwd_mem_bytes=10**6, tail_mem_bytes=10**5, fwd_rng_bytes=10**4, gather_bytes=gather_bytes)


def _cost(blocks, rates: MachineRates) -> StepCost:
    return StepCost(blocks=tuple(blocks), batch_size=4, meta={"rates": rates.to_dict()})


@pytest.mark.parametrize("gather_bytes", [1, 3 * 2**20, 10**9])
def test_gather_adds_exactly_its_bytes_at_the_rate(gather_bytes):
    plain, gathering = _block(), _block(gather_bytes)
    extra = block_recompute(gathering, "time", GATHER_RATES) - block_recompute(plain, "time", GATHER_RATES)
    assert extra == pytest.approx(1e3 * gather_bytes / GATHER_RATES.gather_byte_per_s, rel=1e-12)
    assert GATHER_RATES.gather_ms(gather_bytes) == 1e3 * gather_bytes / 4e8


def test_early_stop_never_skips_the_gather():
    """The gather comes before the block's first op: a segment's last block still pays it."""
    cost = _cost([_block(), _block(8 * 10**6)], GATHER_RATES)
    assert skipped_tail(cost.blocks[1], "time", GATHER_RATES) == skipped_tail(cost.blocks[0], "time", GATHER_RATES)
    extra = segment_cost(cost, 1, 1, "time") - segment_cost(cost, 0, 0, "time")
    assert extra == pytest.approx(20.0)  # 8 MB at 0.4 GB/s
    assert recompute_cost(cost, [(0, 1)], "time") == pytest.approx(
        sum(block_recompute(b, "time", GATHER_RATES) for b in cost.blocks)
        - skipped_tail(cost.blocks[1], "time", GATHER_RATES) + 1e3 * RATES.segment_s
    )


def test_without_a_gather_rate_or_bytes_nothing_changes():
    gathering = _block(10**8)
    assert block_recompute(gathering, "time", RATES) == block_recompute(_block(), "time", RATES)
    assert block_recompute(_block(), "time", GATHER_RATES) == block_recompute(_block(), "time", RATES)
    for metric in ("flops", "ms"):  # only the estimated time knows about collectives
        assert block_recompute(gathering, metric) == block_recompute(_block(), metric)


def test_rates_line_and_rate_validation():
    assert "all-gather" not in str(RATES)
    assert "0.40 GB/s all-gather" in str(GATHER_RATES)
    with pytest.raises(ValueError, match=r"gather_byte_per_s=0 must be a positive finite rate, or None"):
        dataclasses.replace(RATES, gather_byte_per_s=0)
    with pytest.raises(ValueError, match=r"gather_bytes=-1 is negative"):
        _block(-1)


def test_json_from_before_the_gather_fields_still_loads():
    cost = _cost([_block(5 * 10**6)], GATHER_RATES)
    data = json.loads(json.dumps(cost.to_dict()))
    assert StepCost.from_dict(data) == cost and StepCost.from_dict(data).rates == GATHER_RATES
    del data["meta"]["rates"]["gather_byte_per_s"]
    for block in data["blocks"]:
        del block["gather_bytes"]
    old = StepCost.from_dict(data)
    assert old.blocks[0].gather_bytes == 0 and old.rates.gather_byte_per_s is None
    assert old.rates == RATES


def test_per_call_cost_counts_the_calls_a_recompute_makes():
    calls = tuple(OpCost("aten.gelu.default", j, 4, True, True, in_tail=j >= 3, mem_bytes=100) for j in range(5))
    blk = BlockCost("b", 10, 1, fwd_mem_bytes=500, tail_mem_bytes=200, ops=calls)
    rates = MachineRates(flop_per_s=1e9, mem_byte_per_s=1e5, rng_byte_per_s=1e5, op_call_s=1e-3)
    assert op_calls(blk) == 5 and op_calls(blk, tail=True) == 2
    assert block_recompute(blk, "time", rates) == pytest.approx(5.0 + 5.0)
    assert skipped_tail(blk, "time", rates) == pytest.approx(2.0 + 2.0)
    bare = dataclasses.replace(rates, op_call_s=0.0)
    assert block_recompute(blk, "time", bare) == pytest.approx(5.0)
    # a block profiled without its calls pays nothing per call
    assert block_recompute(BlockCost("c", 10, 1, fwd_mem_bytes=500), "time", rates) == pytest.approx(5.0)
    assert "1000.0 us per op call" in str(rates)
