"""The multi-level planner against brute force over every nested plan, and its slots.

With budgets of at most `slots` bytes above the base the slot is one byte and
`solve_nested` must equal the least recompute over every plan nested up to its depth
(`oracles.brute_force_nested`, which evaluates each plan with `predict_peak` and
`recompute_cost`). With real sizes the slots round every need up: the plan still fits,
and costs no less than the optimum.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from oracles import all_nested_plans, brute_force_nested, nested_plan_table

from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.planning.memory_model import base_bytes, predict_peak
from lightning_ckpt.planning.nested_model import depth_of
from lightning_ckpt.planning.nested_planner import NESTED_MAX_BLOCKS, solve_nested, solve_nested_levels
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan
from lightning_ckpt.planning.recompute_cost import recompute_cost


def deep_cost(rng: random.Random, n: int, scale: int = 1, accumulate: bool = False) -> StepCost:
    """Blocks that save much more than their boundaries (where nesting pays), with every
    overlap field, scratch, gradients and now and then a block that does not chain;
    `accumulate`: a micro-batch that accumulates into existing gradients."""
    blocks = []
    for i in range(n):
        x = rng.randint(1, 6)
        xs = x if rng.random() < 0.5 else 0
        out = rng.randint(1, 6)
        blocks.append(
            BlockCost(
                f"b{i}",
                saved_bytes=scale * (rng.randint(10, 60) + xs),
                input_bytes=scale * x,
                input_saved_bytes=scale * xs,
                shared_with_previous_bytes=scale * rng.choice((0, 0, x)) if i else 0,
                input_saved_by_previous_bytes=scale * rng.choice((0, 0, x)) if i else 0,
                output_bytes=scale * out,
                output_saved_bytes=(out_saved := scale * rng.choice((0, out))),
                fwd_transient_bytes=scale * rng.randint(0, 10),
                stop_output_bytes=scale * out - out_saved if i % 3 == 1 else 0,  # (no draw, as below)
                bwd_transient_bytes=(bwd := scale * rng.randint(0, 10)),
                kept_grads_bwd_transient_bytes=bwd // 2 if i % 2 else None,  # (no draw: the streams stay as they were)
                grad_bytes=scale * rng.randint(0, 3),
                fwd_flops=rng.randint(1, 50),
                tail_flops=0,
                chains_from_previous=rng.random() < 0.95,
            )
        )
    return StepCost(
        blocks=tuple(blocks),
        batch_size=4,
        static_bytes=scale * rng.randint(0, 20),
        outside_grad_bytes=scale * rng.randint(0, 5),
        post_saved_bytes=scale * rng.randint(0, 10),
        grads_live_in_forward=rng.random() < 0.5,
        grads_accumulate=accumulate,
    )


def _budgets(rng: random.Random, cost: StepCost) -> list[int]:
    """Budgets from halfway between the base bytes and `full`'s peak to a little over that peak."""
    full = predict_peak(cost, [(i, i) for i in range(cost.n_blocks)]).peak_bytes
    lo = (base_bytes(cost) + full) // 2
    return sorted({rng.randint(lo, full + 10) for _ in range(4)} | {full - 1})


def _check(cost: StepCost, budget: int, levels: int, table=None) -> str:
    """'' when solve_nested equals brute force; which kind of answer it was otherwise. `table`: the
    brute force's evaluated plans of `cost` (`oracles.nested_plan_table`), shared by its budgets."""
    want = brute_force_nested(cost, budget, levels, table=table)
    got = solve_nested(cost, budget, "flops", levels)
    assert (want is None) == (got is None), (budget, levels, want, got)
    if got is None:
        return "none"
    assert got.slot_bytes == 1
    assert got.cost == pytest.approx(want[0], abs=1e-9)
    # the plan it returns is what it says: it fits, costs that much, nests at most `levels` deep
    assert predict_peak(cost, got.segments, None, got.inner).peak_bytes <= budget
    assert recompute_cost(cost, got.segments, "flops", None, got.inner) == pytest.approx(got.cost, abs=1e-9)
    assert depth_of(got.segments, got.inner) <= levels
    return "nested" if got.inner else "single"


def test_equals_brute_force_on_small_chains():
    rng, flags = random.Random(0), random.Random(10)  # the flag from its own stream: the chains stay those of rng
    kinds = []
    for _ in range(110):
        n = rng.randint(1, 6)
        cost = deep_cost(rng, n, accumulate=flags.random() < 0.5)
        levels = rng.choice((1, 2, 3))
        table = nested_plan_table(cost, levels)
        for budget in _budgets(rng, cost):
            kinds.append(_check(cost, budget, levels, table))
    # the cases cover all three answers, multi-level ones many times
    assert kinds.count("nested") >= 30 and kinds.count("single") >= 30 and kinds.count("none") >= 20, [kinds.count(k) for k in ("nested", "single", "none")]


def test_equals_brute_force_on_eight_blocks():
    rng = random.Random(1)
    kinds = []
    for accumulate in (False, True):
        cost = deep_cost(rng, 8, accumulate=accumulate)
        table = nested_plan_table(cost, 2)
        for budget in _budgets(rng, cost)[:3]:
            kinds.append(_check(cost, budget, 2, table))
    assert "nested" in kinds


def test_brute_force_enumerates_nested_plans():
    """The oracle itself: one block has 2 plans; two blocks 5 at depth 1 and 8 at depth 2
    (the segment [0, 1] may rebuild [0, 0], [1, 1] or both inside)."""
    cost = deep_cost(random.Random(2), 2)
    cost = dataclasses.replace(cost, blocks=tuple(dataclasses.replace(b, chains_from_previous=True) for b in cost.blocks))
    assert len(list(all_nested_plans(dataclasses.replace(cost, blocks=cost.blocks[:1]), 3))) == 2
    assert len(list(all_nested_plans(cost, 1))) == 5
    plans = list(all_nested_plans(cost, 2))
    assert len(plans) == 8
    assert ([(0, 1)], [(0, 0)]) in plans and ([(0, 1)], [(1, 1)]) in plans


def test_real_sizes_round_up_and_still_fit():
    """Bytes scaled by a million: slots of many bytes. Every answer fits and costs at least the
    exact optimum (found at one-byte slots on the unscaled chain), and it is found whenever a
    plan fits with a little room to spare."""
    rng, flags = random.Random(3), random.Random(13)
    for _ in range(30):
        n = rng.randint(3, 6)
        seed = rng.random()
        accumulate = flags.random() < 0.5
        small = deep_cost(random.Random(seed), n, accumulate=accumulate)
        big = deep_cost(random.Random(seed), n, scale=10**6, accumulate=accumulate)
        for budget in _budgets(rng, small):
            exact = solve_nested(small, budget, "flops", 2)
            got = solve_nested(big, budget * 10**6, "flops", 2)
            if got is None:
                assert exact is None or solve_nested(small, budget - n - 2, "flops", 2) is None
                continue
            assert got.slot_bytes > 1
            assert predict_peak(big, got.segments, None, got.inner).peak_bytes <= budget * 10**6
            assert exact is not None and got.cost >= exact.cost - 1e-9


def test_one_set_of_tables_answers_every_budget():
    """The tables built for the largest budget hold every smaller one: read back at its own
    memory level, each plan costs what a solve at that budget alone finds (one-byte slots, so
    both are exact), fits that budget, and is None exactly where that solve is."""
    rng = random.Random(6)
    answered = 0
    for _ in range(40):
        cost = deep_cost(rng, rng.randint(1, 6), accumulate=rng.random() < 0.3)
        levels = rng.choice((1, 2, 3))
        budgets = _budgets(rng, cost) + [base_bytes(cost) - 1]
        together = solve_nested_levels(cost, budgets, "flops", levels)
        for budget, got in zip(budgets, together):
            alone = solve_nested(cost, budget, "flops", levels)
            assert (got is None) == (alone is None), (budget, got, alone)
            if got is None:
                continue
            answered += 1
            assert got.slot_bytes == 1 and got.cost == pytest.approx(alone.cost, abs=1e-9)
            assert predict_peak(cost, got.segments, None, got.inner).peak_bytes <= budget
            assert recompute_cost(cost, got.segments, "flops", None, got.inner) == pytest.approx(got.cost, abs=1e-9)
    assert answered >= 60
    assert solve_nested_levels(deep_cost(rng, 3), [], "flops", 2) == []


def test_real_sizes_read_back_at_smaller_budgets_still_fit():
    """With slots of many bytes a smaller budget is read back in the larger one's slot size:
    its plan fits it and costs no less than the exact optimum."""
    rng = random.Random(7)
    for _ in range(20):
        seed = rng.random()
        small = deep_cost(random.Random(seed), rng.randint(3, 6))
        big = deep_cost(random.Random(seed), small.n_blocks, scale=10**6)
        budgets = _budgets(rng, small)
        for budget, got in zip(budgets, solve_nested_levels(big, [b * 10**6 for b in budgets], "flops", 2)):
            if got is None:
                continue
            exact = solve_nested(small, budget, "flops", 2)
            assert predict_peak(big, got.segments, None, got.inner).peak_bytes <= budget * 10**6
            assert exact is not None and got.cost >= exact.cost - 1e-9


def test_max_depth_must_be_positive():
    with pytest.raises(ValueError, match=r"max_depth=0 must be >= 1"):
        solve_nested(deep_cost(random.Random(4), 3), 10**6, "flops", 0)


def test_make_plan_nests_only_when_it_fits_or_recomputes_less():
    rng = random.Random(5)
    seen = set()
    for _ in range(60):
        cost = deep_cost(rng, rng.randint(2, 6))
        for budget in _budgets(rng, cost):
            try:
                single = make_plan(cost, "optimal", budget, max_levels=1)
            except InfeasibleBudgetError:
                single = None
            try:
                plan = make_plan(cost, "optimal", budget, max_levels=3)
            except InfeasibleBudgetError:
                assert single is None
                continue
            assert plan.fits
            if plan.inner_segments:
                seen.add("needed" if single is None else "cheaper")
                assert single is None or plan.recompute_flops < single.recompute_flops
            else:
                assert single is not None and plan.segments == single.segments
    assert "needed" in seen


def test_long_chains_are_planned_single_level_and_say_so():
    n = NESTED_MAX_BLOCKS + 1
    block = BlockCost("b", saved_bytes=100, input_bytes=1, output_bytes=1, fwd_flops=1)
    cost = StepCost(blocks=(block,) * n, batch_size=1)
    hi = least_single_level_budget(cost)
    with pytest.raises(InfeasibleBudgetError, match=rf"nested segments were not searched: the chain has {n} blocks"):
        make_plan(cost, "optimal", hi - 1)
    with pytest.raises(InfeasibleBudgetError, match=r"max_levels=1: raise it"):
        make_plan(cost, "optimal", hi - 1, max_levels=1)
    with pytest.raises(ValueError, match=r"max_levels=0 must be an integer >= 1"):
        make_plan(cost, "optimal", hi, max_levels=0)
    # the same chain cut to the planner's length does nest at that budget's share of it
    short = StepCost(blocks=(block,) * NESTED_MAX_BLOCKS, batch_size=1)
    assert make_plan(short, "optimal", least_single_level_budget(short) - 1).inner_segments


def least_single_level_budget(cost: StepCost) -> int:
    lo, hi = base_bytes(cost), make_plan(cost, "full").predicted_peak_bytes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            make_plan(cost, "optimal", mid, max_levels=1)
            hi = mid
        except InfeasibleBudgetError:
            lo = mid
    return hi
