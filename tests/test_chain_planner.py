"""The fast chain planner (`chain_planner.solve_chain`) against the oracles of tests/oracles.py:
brute force (peaks from the phase walk) and the reference DP (the scalar element form).

Timing claims (1,000 blocks in under a second) live in benchmarks/chain_planner.py,
not here; these tests only check that the answer is exact for the memory model:
least recompute whose predicted peak fits, ties broken by the lowest peak.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import (
    all_plans,
    brute_force,
    chainable,
    reference_optimal_segments,
    walk_peak,
)
from test_policies import random_cost, step_costs, uniform

from lightning_ckpt.planning.all_kept import all_kept_optimum
from lightning_ckpt.planning.chain_arrays import chain_arrays
from lightning_ckpt.planning.chain_planner import solve_chain
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan, optimal_segments
from lightning_ckpt.planning.segment_shapes import every_k_segments
from lightning_ckpt.planning.recompute_cost import recompute_cost

BEAMS = (0, 1, 3)  # 0: one uncapped run; >0: a beam run bounds the exact run (forced on small chains)


def rich_cost(rng: random.Random, n: int, huge: bool = True) -> StepCost:
    """Random chains with the corners `random_cost` misses: zero bytes and zero FLOPs,
    skipped tails, blocks whose gradients outweigh their activations, frequent
    unchainable blocks, and (`huge`) FLOPs beyond float precision (ties only exact in ints)."""
    unit = rng.choice((1, 1, 1, 2**50 + 1)) if huge else 1
    blocks = []
    for i in range(n):
        x = rng.choice((0, rng.randint(1, 40)))
        saved = rng.choice((0, rng.randint(0, 300)))
        saves_input = rng.random() < 0.5
        flops = unit * rng.choice((0, rng.randint(1, 8), rng.randint(1, 60)))
        # storages saved by this block and the previous one too (e.g. its output kept by a
        # ReLU there and by a conv here): the `boundary_shifts` corrections
        shared = rng.choice((0, 0, x, rng.randint(0, 50))) if i else 0
        by_prev = rng.choice((0, 0, x, rng.randint(0, x))) if i else 0
        out = rng.choice((0, rng.randint(1, 40)))
        blocks.append(
            BlockCost(
                f"b{i}",
                saved_bytes=saved + (x if saves_input else 0),
                input_bytes=x,
                input_saved_bytes=x if saves_input else 0,
                shared_with_previous_bytes=shared,
                input_saved_by_previous_bytes=by_prev,
                output_bytes=out,
                output_saved_bytes=(out_saved := rng.choice((0, out, rng.randint(0, out)))),
                fwd_transient_bytes=rng.choice((0, rng.randint(0, 80))),
                stop_output_bytes=out - out_saved if i % 3 == 1 else 0,  # (no draw: the streams stay as they were)
                ckpt_fwd_peak_bytes=rng.choice((None, rng.randint(0, 120))),
                bwd_transient_bytes=(bwd := rng.choice((0, rng.randint(0, 80)))),
                kept_grads_bwd_transient_bytes=bwd // 2 if i % 2 else None,  # (no draw: the streams stay as they were)
                grad_bytes=rng.choice((0, rng.randint(0, 20), rng.randint(0, 400))),
                fwd_flops=flops,
                tail_flops=rng.choice((0, rng.randint(0, flops))) if flops else 0,
                chains_from_previous=rng.random() < 0.75,
            )
        )
    return StepCost(
        blocks=tuple(blocks),
        batch_size=2,
        static_bytes=rng.randint(0, 100),
        outside_grad_bytes=rng.randint(0, 30),
        pre_saved_bytes=rng.randint(0, 30),
        post_saved_bytes=rng.randint(0, 80),
        post_forward_bytes=rng.choice((None, rng.randint(0, 80))),
        grads_live_in_forward=rng.random() < 0.5,
        optimizer_transient_bytes=rng.choice((0, rng.randint(0, 200))),
        grads_accumulate=rng.random() < 0.5,
    )


def budgets_for(rng: random.Random, cost: StepCost, k: int) -> list[int]:
    """Budgets around the `full`..`none` range, some exactly at a plan's peak."""
    n = cost.n_blocks
    lo = predict_peak(cost, every_k_segments(n, 1)).peak_bytes if n else predict_peak(cost, []).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    out = [rng.randint(min(lo, hi) - 20, max(lo, hi) + 5) for _ in range(k)]
    plans = list(all_plans(n)) if n <= 6 else [every_k_segments(n, 2), [(0, n // 2)] if n > 1 else []]
    out.append(predict_peak(cost, rng.choice(plans)).peak_bytes)  # the budget is hit exactly
    return out


def outcomes(cost: StepCost) -> list[tuple[int, int]]:
    """(recompute, peak) of every valid plan: brute force for many budgets at once."""
    return [(recompute_cost(cost, segs), walk_peak(cost, segs).peak_bytes) for segs in all_plans(cost.n_blocks) if chainable(cost, segs)]


def check(cost: StepCost, budget: int, expected: tuple | None, **kw) -> None:
    """`solve_chain` gives exactly `expected` = (least recompute, lowest peak), or None."""
    sol = solve_chain(cost, budget, **kw)
    if expected is None:
        assert sol is None, (budget, sol)
        return
    assert sol is not None, (budget, expected)
    peak = predict_peak(cost, sol.segments).peak_bytes
    got = (recompute_cost(cost, sol.segments), peak)
    assert got == tuple(expected), (budget, got, expected, sol.segments)
    assert sol.peak_bytes == peak and sol.cost == got[0]
    assert chainable(cost, sol.segments)


@pytest.mark.parametrize("seed", range(250))
def test_random_cost_equals_brute_force(seed):
    """The planner test suite's chains (`random_cost`), n up to 10, every solver mode."""
    rng = random.Random(10_000 + seed)
    n = rng.randint(1, 10 if seed % 50 == 0 else 7)
    cost = random_cost(rng, n)
    budget = budgets_for(rng, cost, 1)[seed % 2]
    bf = brute_force(cost, budget)
    for beam in BEAMS:
        check(cost, budget, None if bf is None else bf[0], beam=beam)


@pytest.mark.parametrize("seed", range(250))
def test_corner_chains_equal_brute_force(seed):
    """Zero costs, tails, unchainable blocks, huge FLOPs, budgets hit exactly."""
    rng = random.Random(20_000 + seed)
    n = rng.randint(0, 10 if seed % 50 == 0 else 7)
    cost = rich_cost(rng, n)
    table = outcomes(cost)
    for budget in budgets_for(rng, cost, 3):
        fits = [o for o in table if o[1] <= budget]
        expected = min(fits) if fits else None
        for beam in BEAMS:
            check(cost, budget, expected, beam=beam)


@pytest.mark.parametrize("seed", range(60))
def test_first_block_overlap_fields_are_ignored(seed):
    """Block 0 has no block before it, so what it would share with one is never
    resident elsewhere: the model ignores those fields and the planner may not count
    on them (plans within the budget, equal to brute force)."""
    rng = random.Random(80_000 + seed)
    cost = rich_cost(rng, rng.randint(1, 6))
    first = cost.blocks[0]
    odd = dataclasses.replace(
        first,
        shared_with_previous_bytes=rng.randint(1, 60),
        input_saved_by_previous_bytes=rng.randint(0, first.input_bytes),
    )
    odd_cost = dataclasses.replace(cost, blocks=(odd, *cost.blocks[1:]))
    table = outcomes(odd_cost)
    assert table == outcomes(cost)
    for budget in budgets_for(rng, odd_cost, 3):
        fits = [o for o in table if o[1] <= budget]
        for beam in BEAMS:
            check(odd_cost, budget, min(fits) if fits else None, beam=beam)


@pytest.mark.parametrize("seed", range(24))
def test_equals_reference_dp_on_longer_chains(seed):
    """n = 20..60: the reference forward DP with its bisection tie-break."""
    rng = random.Random(30_000 + seed)
    n = rng.randint(20, 60)
    # the reference sums FLOPs in floats, so no FLOPs beyond 2**53 here (brute force covers those)
    cost = random_cost(rng, n) if seed % 2 else rich_cost(rng, n, huge=False)
    lo = predict_peak(cost, every_k_segments(n, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = min(lo, hi) + int(rng.uniform(0.05, 1.0) * abs(hi - lo))
    ref = reference_optimal_segments(cost, budget)
    expected = None if ref is None else (recompute_cost(cost, ref), predict_peak(cost, ref).peak_bytes)
    for beam in (0, 4, 16):
        check(cost, budget, expected, beam=beam)


@pytest.mark.parametrize("frac", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_uniform_chain_equals_reference(frac):
    cost = uniform(40)
    lo = predict_peak(cost, every_k_segments(40, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = int(lo + frac * (hi - lo))
    ref = reference_optimal_segments(cost, budget)
    for beam in (0, 16):
        check(cost, budget, (recompute_cost(cost, ref), predict_peak(cost, ref).peak_bytes), beam=beam)


@pytest.mark.parametrize("seed", range(30))
def test_max_segment_blocks_equals_reference(seed):
    rng = random.Random(40_000 + seed)
    n = rng.randint(8, 24)
    cost = random_cost(rng, n)
    lo = predict_peak(cost, every_k_segments(n, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = min(lo, hi) + int(rng.uniform(0.0, 1.0) * abs(hi - lo))
    k = rng.randint(1, 4)
    ref = reference_optimal_segments(cost, budget, max_segment_blocks=k)
    expected = None if ref is None else (recompute_cost(cost, ref), predict_peak(cost, ref).peak_bytes)
    for beam in (0, 3):
        check(cost, budget, expected, beam=beam, max_segment_blocks=k)
    sol = solve_chain(cost, budget, max_segment_blocks=k)
    assert sol is None or all(b - a + 1 <= k for a, b in sol.segments)


@pytest.mark.parametrize("seed", range(40))
def test_ms_metric_matches_reference_cost(seed):
    """Costs in milliseconds are floats: the least recompute agrees up to rounding."""
    rng = random.Random(50_000 + seed)
    n = rng.randint(5, 30)
    base = rich_cost(rng, n)
    blocks = tuple(
        BlockCost(**{**b.__dict__, "fwd_ms": rng.choice((0.0, rng.uniform(0.01, 9.0))), "fwd_flops": rng.randint(1, 50)})
        for b in base.blocks
    )
    blocks = tuple(BlockCost(**{**b.__dict__, "tail_flops": min(b.tail_flops, b.fwd_flops)}) for b in blocks)
    cost = StepCost(**{**base.__dict__, "blocks": blocks})
    lo = predict_peak(cost, every_k_segments(n, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = min(lo, hi) + int(rng.uniform(0.0, 1.0) * abs(hi - lo))
    ref = reference_optimal_segments(cost, budget, metric="ms")
    for beam in (0, 3):
        sol = solve_chain(cost, budget, metric="ms", beam=beam)
        assert (sol is None) == (ref is None)
        if sol is not None:
            assert predict_peak(cost, sol.segments).peak_bytes <= budget
            assert recompute_cost(cost, sol.segments, "ms") == pytest.approx(recompute_cost(cost, ref, "ms"), rel=1e-9, abs=1e-9)


# 1 ns per FLOP and per memory-bound byte, 4 ns per random byte: every estimate is whole nanoseconds
NS_RATES = MachineRates(flop_per_s=1e9, mem_byte_per_s=1e9, rng_byte_per_s=2.5e8)


def with_work(rng: random.Random, cost: StepCost, rates: MachineRates = NS_RATES) -> StepCost:
    """`cost` with random memory-bound and random bytes (and their tails) and machine rates."""
    blocks = []
    for b in cost.blocks:
        mem, rnd = rng.choice((0, rng.randint(1, 60))), rng.choice((0, 0, rng.randint(1, 20)))
        blocks.append(
            BlockCost(
                **{
                    **b.__dict__,
                    "fwd_mem_bytes": mem,
                    "tail_mem_bytes": rng.choice((0, rng.randint(0, mem))),
                    "fwd_rng_bytes": rnd,
                    "tail_rng_bytes": rng.choice((0, rng.randint(0, rnd))),
                }
            )
        )
    return StepCost(**{**cost.__dict__, "blocks": tuple(blocks), "meta": {"rates": rates.to_dict()}})


def ns(ms: float) -> int:
    return round(ms * 1e6)


@pytest.mark.parametrize("seed", range(60))
def test_time_metric_equals_brute_force_exactly(seed):
    """Estimated times tie exactly (whole nanoseconds in int64), so the lowest peak wins."""
    rng = random.Random(60_000 + seed)
    n = rng.randint(1, 7)
    # every other seed: a fixed cost per checkpointed segment (whole nanoseconds too)
    rates = NS_RATES if seed % 2 else dataclasses.replace(NS_RATES, segment_s=rng.choice((1e-9, 7e-9, 3e-8)))
    cost = with_work(rng, rich_cost(rng, n, huge=False), rates)
    table = []
    for segs in all_plans(n):
        if chainable(cost, segs):
            table.append((ns(recompute_cost(cost, segs, "time")), walk_peak(cost, segs).peak_bytes))
    for budget in budgets_for(rng, cost, 3):
        fits = [o for o in table if o[1] <= budget]
        expected = min(fits) if fits else None
        for beam in BEAMS:
            sol = solve_chain(cost, budget, metric="time", beam=beam)
            if expected is None:
                assert sol is None
                continue
            got = (ns(recompute_cost(cost, sol.segments, "time")), predict_peak(cost, sol.segments).peak_bytes)
            assert got == expected, (budget, got, expected, sol.segments)
            assert ns(sol.cost) == got[0] and sol.peak_bytes == got[1]


@pytest.mark.parametrize("seed", range(12))
def test_time_metric_matches_reference_dp_with_measured_like_rates(seed):
    """Rates that are not whole nanoseconds: the least recompute agrees with the float reference."""
    rng = random.Random(70_000 + seed)
    n = rng.randint(20, 40)
    rates = MachineRates(
        flop_per_s=rng.uniform(1e8, 1e9), mem_byte_per_s=rng.uniform(1e7, 1e9), rng_byte_per_s=rng.uniform(1e6, 1e8),
        segment_s=rng.choice((0.0, rng.uniform(1e-9, 5e-8))),
    )
    cost = with_work(rng, rich_cost(rng, n, huge=False), rates)
    lo = predict_peak(cost, every_k_segments(n, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = min(lo, hi) + int(rng.uniform(0.05, 1.0) * abs(hi - lo))
    ref = reference_optimal_segments(cost, budget, metric="time")
    for beam in (0, 3):
        sol = solve_chain(cost, budget, metric="time", beam=beam)
        assert (sol is None) == (ref is None)
        if sol is not None:
            assert predict_peak(cost, sol.segments).peak_bytes <= budget
            # each block is rounded to whole nanoseconds in the solver: at most 1 ns per block apart
            assert recompute_cost(cost, sol.segments, "time") == pytest.approx(recompute_cost(cost, ref, "time"), abs=n * 1e-6)


def test_huge_flops_ties_are_exact():
    """FLOPs beyond 2**53: two plans that differ by one FLOP are told apart."""
    big = 2**60
    blocks = (
        BlockCost("a", saved_bytes=100, input_bytes=1, fwd_flops=big + 1),
        BlockCost("b", saved_bytes=100, input_bytes=1, fwd_flops=big),
        BlockCost("c", saved_bytes=10, input_bytes=1, fwd_flops=1),
    )
    cost = StepCost(blocks=blocks, batch_size=1)
    # 205 bytes: `none` peaks at 210; checkpointing "a" (peak 111) or "b" (peak 201)
    # fits, "c" alone does not. In floats both cost 2**60 and the lower peak would win.
    sol = solve_chain(cost, 205)
    assert sol.segments == [(1, 1)] and sol.cost == big


def test_planner_entry_points_use_the_fast_solver():
    cost = uniform(300)
    lo = predict_peak(cost, every_k_segments(300, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = (lo + hi) // 2
    segs = optimal_segments(cost, budget)
    plan = make_plan(cost, "optimal", budget)
    assert list(plan.segments) == segs and plan.fits
    # one segment of 143 blocks (+ its boundary) beside 157 kept blocks fills the budget
    assert plan.recompute_flops == 143 * 100
    with pytest.raises(InfeasibleBudgetError):
        optimal_segments(cost, 10 * 2**20)  # below even one block's rebuilt interior



@pytest.mark.parametrize("cheap", [0, 1])
def test_time_metric_recomputes_the_block_whose_gather_is_cheap(cheap):
    """Blocks 0 and 1 free the same bytes at the same FLOPs (checkpointing either peaks at 201
    bytes, nothing at 300), but one's recompute all-gathers 4 MB of parameters again (ZeRO-3)
    and the other's 1 MB: within 250 bytes `optimal` in `time` recomputes the cheap gather,
    whichever of the two it is; without a gather rate they cost the same."""
    gathers = [4 * 10**6, 4 * 10**6, 0]
    gathers[cheap] = 10**6
    blocks = tuple(
        BlockCost(f"b{i}", saved_bytes=100, input_bytes=1, fwd_flops=1000, gather_bytes=g) for i, g in enumerate(gathers)
    )
    rates = dataclasses.replace(NS_RATES, gather_byte_per_s=1e9)
    cost = StepCost(blocks=blocks, batch_size=1, meta={"rates": rates.to_dict()})
    assert predict_peak(cost, [(0, 0)]).peak_bytes == predict_peak(cost, [(1, 1)]).peak_bytes == 201
    assert predict_peak(cost, []).peak_bytes == 300
    for beam in BEAMS:
        sol = solve_chain(cost, 250, metric="time", beam=beam)
        assert sol.segments == [(cheap, cheap)] and sol.cost == pytest.approx(1e-3 + 1.0)  # 1 us FLOPs + 1 ms gather
    plan = make_plan(cost, "optimal", 250, metric="time")
    assert plan.segments == ((cheap, cheap),)
    assert "1.00 GB/s all-gather" in str(plan) and "parameters all-gathered again" in str(plan)
    plain = StepCost(blocks=blocks, batch_size=1, meta={"rates": NS_RATES.to_dict()})
    assert solve_chain(plain, 250, metric="time").cost == pytest.approx(1e-3)


@pytest.mark.parametrize("seed", range(40))
def test_a_plan_that_checkpoints_nothing_is_found_without_the_search_exactly_as_the_search_finds_it(seed, monkeypatch):
    """Where keeping every block fits and every segment costs recompute, that plan is the only one of cost 0:
    it is returned without running the DP, the same solution the DP returns (run in full with `stats`)."""
    import lightning_ckpt.planning.chain_planner as chain_planner

    rng = random.Random(30_000 + seed)
    cost = rich_cost(rng, rng.randint(1, 8)) if seed % 2 else uniform(rng.randint(1, 12))
    kept = predict_peak(cost, []).peak_bytes
    runs = []
    real_solve = chain_planner._solve
    monkeypatch.setattr(chain_planner, "_solve", lambda *a, **kw: runs.append(1) or real_solve(*a, **kw))
    for budget in (kept - 1, kept, kept + rng.randint(1, 10**6)):
        runs.clear()
        got = solve_chain(cost, budget)
        searched = bool(runs)
        assert got == solve_chain(cost, budget, stats={}), (budget, got)
        if budget >= kept and seed % 2 == 0:  # uniform: every block's recompute is positive
            assert got is not None and got.segments == [] and not searched


@settings(max_examples=300, deadline=None)
@given(
    cost=step_costs,
    rnd=st.randoms(use_true_random=False),
    metric=st.sampled_from(["flops", "ms", "time", "time_overhead", "huge_flops"]),
    delta=st.one_of(st.integers(-3, 3), st.integers(-(10**6), 10**7)),
)
def test_the_scalar_test_for_keeping_every_block_agrees_with_the_search(cost, rnd, metric, delta):
    """`all_kept_optimum` decides from the cost alone what the search decides on its columns: where it
    answers, the search (run in full with `stats`) returns that same solution, types of the cost included."""
    if metric == "huge_flops":  # float64 costs: FLOPs past the int64 sums
        big = 2**50
        blocks = tuple(dataclasses.replace(b, fwd_flops=b.fwd_flops * big, tail_flops=b.tail_flops * big) for b in cost.blocks)
        cost, metric = dataclasses.replace(cost, blocks=blocks), "flops"
    if metric == "ms":
        blocks = tuple(dataclasses.replace(b, fwd_ms=rnd.choice((0.0, rnd.uniform(0, 3)))) for b in cost.blocks)
        cost = dataclasses.replace(cost, blocks=blocks)
    if metric.startswith("time"):
        rates = dataclasses.replace(NS_RATES, segment_s=7e-9) if metric == "time_overhead" else NS_RATES
        cost, metric = with_work(rnd, cost, rates), "time"
    budget = predict_peak(cost, []).peak_bytes + delta
    found = all_kept_optimum(cost, budget, metric)
    full = solve_chain(cost, budget, metric=metric, stats={})
    assert solve_chain(cost, budget, metric=metric) == full
    if found is not None:
        assert full is not None and full.segments == [] and not full.keeps
        assert (found[0], found[1]) == (full.cost, full.peak_bytes) and type(found[0]) is type(full.cost)
    elif full is not None and not full.segments and cost.n_blocks:  # undecided only where a segment may cost 0
        a = chain_arrays(cost, metric)
        assert not np.all(a.K[1:] - np.maximum.accumulate(a.P[:-1]) > 0)


@pytest.mark.parametrize("seed", range(15))
def test_recompute_ends_that_vary_along_the_chain_equal_brute_force(seed):
    """Blocks whose recompute ends holding their output or not (`stop_output_bytes`, drawn per block): a
    longer segment's end need not cover a shorter one's, and the pool's dominance must still keep the best."""
    rng = random.Random(seed)
    cost = rich_cost(rng, rng.randint(3, 8))
    blocks = tuple(
        dataclasses.replace(b, stop_output_bytes=rng.choice((0, b.output_bytes - b.output_saved_bytes)))
        for b in cost.blocks
    )
    cost = dataclasses.replace(cost, blocks=blocks)
    table = outcomes(cost)
    for budget in budgets_for(rng, cost, 3):
        fits = [o for o in table if o[1] <= budget]
        for beam in BEAMS:
            check(cost, budget, min(fits) if fits else None, beam=beam)
