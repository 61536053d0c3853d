"""A linear combination of step costs, field by field: each quantity added up product by product, in order."""

from __future__ import annotations

import dataclasses

from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost
from lightning_ckpt.planning.cost_combination import CostCombination, combine_costs


def _op(i: int, keep: int, saved: bool = True) -> OpCost:
    return OpCost(op="aten.mm.default", call_index=i, keep_bytes=keep, saved=saved, keepable=True, flops=10 * keep)


def _step(scale: int, peak: int | None = 100, ops: bool = True) -> StepCost:
    blocks = tuple(
        BlockCost(
            name=f"b{i}",
            saved_bytes=1000 * scale * (i + 1),
            input_bytes=300 * scale,
            input_saved_bytes=200 * scale,
            output_bytes=300 * scale,
            fwd_transient_bytes=50 * scale,
            ckpt_fwd_peak_bytes=None if peak is None else peak * scale,
            fwd_flops=7000 * scale,
            tail_flops=1000 * scale,
            fwd_ms=0.5 * scale,
            grad_bytes=4096,
            ops=(_op(0, 100 * scale), _op(1, 30 * scale, saved=scale != 3)) if ops else (),
        )
        for i in range(2)
    )
    return StepCost(blocks=blocks, batch_size=4, batch_bytes=64 * scale, pre_saved_bytes=8 * scale,
                    meta={"step_fwd_flops": 14000 * scale, "work": "cpu"})


def _by_hand(w, values):
    total = 0
    for a, b in zip(w, values):
        total += a * b
    return total


def test_each_quantity_is_the_same_combination_of_the_costs_rounded_and_at_least_zero():
    costs = [_step(1), _step(2), _step(3)]
    w = (0.3, -1.1, 1.2)
    got = combine_costs(costs, w)
    for i, block in enumerate(got.blocks):
        saved = [c.blocks[i].saved_bytes for c in costs]
        assert block.saved_bytes == round(max(0.0, _by_hand(w, saved)))
        assert block.fwd_ms == max(0.0, _by_hand(w, [c.blocks[i].fwd_ms for c in costs]))
        assert block.ckpt_fwd_peak_bytes == round(max(0.0, _by_hand(w, [c.blocks[i].ckpt_fwd_peak_bytes for c in costs])))
        assert block.grad_bytes == 4096  # not fitted: the first cost's
        assert [o.keep_bytes for o in block.ops] == [
            max(0, round(_by_hand(w, [c.blocks[i].ops[k].keep_bytes for c in costs]))) for k in range(2)
        ]
        assert [o.saved for o in block.ops] == [True, False]  # saved only where every cost saves it
    assert got.batch_bytes == round(max(0.0, _by_hand(w, [64, 128, 192])))
    assert got.meta == {"step_fwd_flops": max(0.0, _by_hand(w, [14000, 28000, 42000])), "work": "cpu"}


def test_a_weight_of_one_on_one_cost_gives_that_cost():
    costs = [_step(1), _step(2), _step(5)]
    assert combine_costs(costs, (0.0, 1.0, 0.0)) == costs[1]


def test_a_field_unknown_in_one_cost_is_unknown_and_ops_that_differ_are_dropped():
    other = _step(2, peak=None)
    other = dataclasses.replace(other, blocks=(dataclasses.replace(other.blocks[0], ops=()), other.blocks[1]))
    got = combine_costs([_step(1), other], (0.5, 0.5))
    assert [b.ckpt_fwd_peak_bytes for b in got.blocks] == [None, None]
    assert got.blocks[0].ops == () and len(got.blocks[1].ops) == 2


def test_one_combination_answers_many_weights_as_combining_each_time_does():
    costs = [_step(1), _step(2), _step(4), _step(7, ops=False)]
    once = CostCombination(costs)
    for w in [(1.0, 0.0, 0.0, 0.0), (0.2, 0.3, -0.4, 0.9), (-2.0, 1.5, 0.25, 0.125)]:
        assert once.combine(w) == combine_costs(costs, w)
        assert all(b.ops == () for b in once.combine(w).blocks)
