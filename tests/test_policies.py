"""Policies: fixed shapes, greedy, and `optimal` against brute force (tests/oracles.py);
`uniform` and `random_cost` are the chains the planner tests share."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import brute_force

from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan, optimal_segments
from lightning_ckpt.planning.segment_shapes import every_k_segments, sqrt_segments
from lightning_ckpt.planning.recompute_cost import recompute_cost

MiB = 2**20


def uniform(n: int, saved: int = 10 * MiB, boundary: int = MiB // 2, flops: int = 100) -> StepCost:
    blocks = tuple(
        BlockCost(f"b{i}", saved_bytes=saved, input_bytes=boundary, input_saved_bytes=boundary, output_bytes=boundary, fwd_flops=flops)
        for i in range(n)
    )
    return StepCost(blocks=blocks, batch_size=8)


def random_cost(rng: random.Random, n: int) -> StepCost:
    blocks = []
    for i in range(n):
        x = rng.randint(1, 20)
        saved = rng.randint(0, 200)
        blocks.append(
            BlockCost(
                f"b{i}",
                saved_bytes=saved + (x if rng.random() < 0.7 else 0),
                input_bytes=x,
                input_saved_bytes=x if rng.random() < 0.7 and saved + x >= x else 0,
                shared_with_previous_bytes=rng.choice((0, x)) if i else 0,
                input_saved_by_previous_bytes=rng.choice((0, x)) if i else 0,
                output_bytes=(out := rng.randint(1, 20)),
                output_saved_bytes=rng.choice((0, out)),
                fwd_transient_bytes=rng.randint(0, 30),
                bwd_transient_bytes=rng.randint(0, 30),
                grad_bytes=rng.randint(0, 10),
                fwd_flops=rng.randint(1, 50),
                chains_from_previous=rng.random() < 0.9,
            )
        )
    # the input_saved flag must be consistent with saved >= input
    blocks = [
        b if b.input_saved_bytes <= b.saved_bytes else BlockCost(**{**b.__dict__, "input_saved_bytes": 0}) for b in blocks
    ]
    static = rng.randint(0, 100)
    return StepCost(
        blocks=tuple(blocks),
        batch_size=4,
        static_bytes=static,
        outside_grad_bytes=rng.randint(0, 20),
        pre_saved_bytes=rng.randint(0, 20),
        post_saved_bytes=rng.randint(0, 60),
        grads_live_in_forward=rng.random() < 0.5,
        # half the chains are accumulating micro-batches, told by a number already drawn, so
        # that `rng` (and every chain the callers draw after this one) stays what it was
        grads_accumulate=static % 2 == 1,
    )


def test_every_k_and_sqrt_shapes():
    assert every_k_segments(10, 4) == [(0, 3), (4, 7), (8, 9)]
    assert sqrt_segments(48) == every_k_segments(48, 7)
    assert sqrt_segments(0) == []
    with pytest.raises(ValueError, match="every_k needs k >= 1, got k=0"):
        every_k_segments(10, 0)


def test_uniform_peak_follows_k_plus_n_over_k():
    """Uniform stack: resident boundaries (n/k of them) plus one rebuilt interior of k blocks."""
    cost = uniform(48)
    for k in (1, 2, 4, 8):
        peak = predict_peak(cost, every_k_segments(48, k)).peak_bytes
        boundaries = (48 // k) * (MiB // 2)
        interior = k * 10 * MiB - MiB // 2 + MiB // 2  # rebuilt minus the shared boundary, plus grad of output
        # the peak is reached in the backward of the last segment: all boundaries + its interior
        assert peak == boundaries + interior
    # no checkpointing: everything saved, plus the last block's output
    assert predict_peak(cost, []).peak_bytes == 48 * 10 * MiB + MiB // 2


def test_hand_table_optimal_picks_the_block_whose_bytes_overlap():
    # Two wide cheap blocks between an expensive embedding and an expensive tail.
    blocks = (
        BlockCost("emb", saved_bytes=10, input_bytes=5, fwd_flops=1000),
        BlockCost("wide1", saved_bytes=400, input_bytes=5, fwd_flops=10),
        BlockCost("wide2", saved_bytes=400, input_bytes=5, fwd_flops=10),
        BlockCost("tail", saved_bytes=20, input_bytes=5, fwd_flops=500),
    )
    cost = StepCost(blocks=blocks, batch_size=1)
    assert predict_peak(cost, []).peak_bytes == 830
    # Checkpointing wide2 would rebuild it on top of wide1 (815 > 600); wide1 is rebuilt alone.
    assert predict_peak(cost, [(2, 2)]).peak_bytes == 815
    assert predict_peak(cost, [(1, 1)]).peak_bytes == 435
    plan = make_plan(cost, "optimal", budget_bytes=600)
    assert plan.checkpointed == (1,)
    assert plan.recompute_flops == 10
    assert plan.fits
    with pytest.raises(InfeasibleBudgetError, match="Lower target_batch_size or raise memory_budget"):
        make_plan(cost, "optimal", budget_bytes=400)


@pytest.mark.parametrize("seed", range(150))
def test_optimal_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7 if seed % 5 else 9)
    cost = random_cost(rng, n)
    lo = predict_peak(cost, every_k_segments(n, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = rng.randint(min(lo, hi) - 20, max(lo, hi) + 5)
    bf = brute_force(cost, budget)
    if bf is None:
        with pytest.raises(InfeasibleBudgetError):
            optimal_segments(cost, budget)
        return
    segs = optimal_segments(cost, budget)
    peak = predict_peak(cost, segs).peak_bytes
    assert peak <= budget
    assert (recompute_cost(cost, segs), peak) == bf[0]


def test_brute_force_up_to_ten_blocks():
    rng = random.Random(1234)
    for _ in range(3):
        cost = random_cost(rng, 10)
        budget = (predict_peak(cost, every_k_segments(10, 1)).peak_bytes + predict_peak(cost, []).peak_bytes) // 2
        bf = brute_force(cost, budget)
        if bf is None:
            continue
        segs = optimal_segments(cost, budget)
        assert (recompute_cost(cost, segs), predict_peak(cost, segs).peak_bytes) == bf[0]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), frac=st.floats(0.0, 1.0))
def test_optimal_never_worse_than_any_fitting_policy(seed, frac):
    rng = random.Random(seed)
    cost = random_cost(rng, rng.randint(2, 14))
    n = cost.n_blocks
    lo = predict_peak(cost, every_k_segments(n, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = int(min(lo, hi) + frac * abs(hi - lo))
    try:
        opt = make_plan(cost, "optimal", budget)
    except InfeasibleBudgetError:
        # then no other policy may fit either
        for policy, k in (("full", None), ("sqrt", None), ("none", None), ("every_k", 2)):
            assert not make_plan(cost, policy, budget, every_k=k).fits
        return
    assert opt.fits
    others = [make_plan(cost, p, budget, every_k=k) for p, k in (("none", None), ("full", None), ("sqrt", None), ("every_k", 3))]
    try:
        others.append(make_plan(cost, "greedy", budget))
    except InfeasibleBudgetError:
        pass
    for other in others:
        if other.fits:
            assert opt.recompute_flops <= other.recompute_flops, (other.policy, other.segments, opt.segments)


def test_policies_need_budget_and_known_names():
    cost = uniform(4)
    with pytest.raises(ValueError, match="policy='fastest' is not a known policy"):
        make_plan(cost, "fastest", 10)
    with pytest.raises(ValueError, match="needs budget_bytes"):
        make_plan(cost, "optimal", None)


def test_unchainable_blocks_are_never_grouped():
    blocks = tuple(
        BlockCost(f"b{i}", saved_bytes=100, input_bytes=5, fwd_flops=1, chains_from_previous=(i != 2)) for i in range(4)
    )
    cost = StepCost(blocks=blocks, batch_size=1)
    plan = make_plan(cost, "every_k", every_k=4)
    assert plan.segments == ((0, 1), (2, 3))
    opt = make_plan(cost, "optimal", budget_bytes=120)
    assert all(not (a < 2 <= b) for a, b in opt.segments)


def test_plan_table_and_dict_roundtrip():
    cost = uniform(6)
    plan = make_plan(cost, "every_k", budget_bytes=40 * MiB, every_k=2)
    text = str(plan)
    assert "checkpoint" in text and "budget 40.0 MiB" in text
    assert len([ln for ln in text.splitlines() if ln.strip().startswith(tuple("012345"))]) == 6
    from lightning_ckpt.planning.plan import Plan

    again = Plan.from_dict(plan.to_dict())
    assert again == plan
    assert plan.to_dict()["checkpointed"] == [0, 1, 2, 3, 4, 5]


# ----------------------------------------------------------------------------- fuzzing

block_costs = st.builds(
    lambda saved, x, saves_input, out, ft, bt, g, fl, chains: BlockCost(
        "b", saved_bytes=saved + (x if saves_input else 0), input_bytes=x, input_saved_bytes=x if saves_input else 0,
        output_bytes=out, fwd_transient_bytes=ft, bwd_transient_bytes=bt, grad_bytes=g, fwd_flops=fl,
        tail_flops=fl // 3, chains_from_previous=chains,
    ),
    st.integers(0, 10**6), st.integers(0, 10**5), st.booleans(), st.integers(0, 10**5), st.integers(0, 10**5),
    st.integers(0, 10**5), st.integers(0, 10**4), st.integers(0, 10**6), st.booleans(),
)
step_costs = st.builds(
    lambda blocks, static, og, pre, post, live, accumulate: StepCost(
        blocks=tuple(blocks), batch_size=1, static_bytes=static, outside_grad_bytes=og, pre_saved_bytes=pre,
        post_saved_bytes=post, grads_live_in_forward=live, grads_accumulate=accumulate,
    ),
    st.lists(block_costs, min_size=0, max_size=12), st.integers(0, 10**6), st.integers(0, 10**4),
    st.integers(0, 10**4), st.integers(0, 10**5), st.booleans(), st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(cost=step_costs, budget=st.integers(0, 2 * 10**7), policy=st.sampled_from(["optimal", "greedy", "every_k"]))
def test_fuzz_planner_never_over_budget_never_crashes(cost, budget, policy):
    try:
        plan = make_plan(cost, policy, budget)
    except InfeasibleBudgetError as err:
        assert "Lower target_batch_size or raise memory_budget" in str(err)
        if policy == "optimal":  # then nothing else fits either
            assert make_plan(cost, "full", budget).predicted_peak_bytes > budget
            assert make_plan(cost, "none").predicted_peak_bytes > budget
        return
    assert plan.fits and plan.predicted_peak_bytes <= budget
    assert plan.predicted_peak_bytes == predict_peak(cost, plan.segments, None, plan.inner_segments).peak_bytes
    assert all(cost.blocks[i].chains_from_previous for a, b in plan.segments for i in range(a + 1, b + 1))


# ----------------------------------------------------------------------------- cost metrics


def _with_rates(cost: StepCost, rates) -> StepCost:
    return StepCost(**{**cost.__dict__, "meta": {**cost.meta, "rates": rates.to_dict()}})


def test_unknown_metric_lists_the_choices():
    with pytest.raises(ValueError, match=r"metric='joules' is not a known recompute cost; choose one of flops, ms, time"):
        make_plan(uniform(4), "optimal", 10**9, metric="joules")


@pytest.mark.parametrize("frac", [k / 10 for k in range(1, 10)])
def test_time_metric_on_identical_blocks_plans_exactly_like_flops(frac):
    """Identical blocks cost the same under both metrics up to a factor, so the plans must be
    the same, tie-breaks included: time costs are summed exactly (whole nanoseconds), not in
    floats where 0.1 + 0.2 != 0.3 would decide between plans of equal cost."""
    from lightning_ckpt.costs.machine_rates import MachineRates

    base = uniform(48)
    blocks = tuple(BlockCost(**{**b.__dict__, "fwd_mem_bytes": 3 * MiB, "fwd_rng_bytes": MiB // 3}) for b in base.blocks)
    cost = _with_rates(StepCost(**{**base.__dict__, "blocks": blocks}), MachineRates(3.1e9, 7.3e9, 0.7e9))
    lo = predict_peak(cost, every_k_segments(48, 1)).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    budget = int(lo + frac * (hi - lo))
    by_flops = make_plan(cost, "optimal", budget, metric="flops")
    by_time = make_plan(cost, "optimal", budget, metric="time")
    assert by_time.segments == by_flops.segments
    assert by_time.predicted_peak_bytes == by_flops.predicted_peak_bytes
    assert make_plan(cost, "greedy", budget, metric="time").segments == make_plan(cost, "greedy", budget).segments


def test_plan_table_shows_the_metric_and_estimated_time_and_roundtrips():
    from lightning_ckpt.costs.machine_rates import MachineRates
    from lightning_ckpt.planning.plan import Plan

    base = uniform(6)
    blocks = tuple(BlockCost(**{**b.__dict__, "fwd_mem_bytes": 10**6}) for b in base.blocks)
    rates = MachineRates(flop_per_s=1e5, mem_byte_per_s=1e9, rng_byte_per_s=1e8)
    cost = _with_rates(StepCost(**{**base.__dict__, "blocks": blocks}), rates)
    plan = make_plan(cost, "every_k", every_k=3, metric="time")
    text = str(plan)
    assert "cost_metric=time" in text and "est. ms" in text
    # each block: 100 FLOPs at 1e5 FLOP/s (1 ms) + 1e6 bytes at 1 GB/s (1 ms)
    assert plan.recompute_est_ms == pytest.approx(6 * 2.0)
    assert all(r.fwd_est_ms == pytest.approx(2.0) for r in plan.rows)
    assert "estimated recompute 12.0 ms" in text and "1.00 GB/s memory-bound" in text
    assert Plan.from_dict(plan.to_dict()) == plan
    # a plan saved before these fields existed still loads
    old = {k: v for k, v in plan.to_dict().items() if k not in ("cost_metric", "recompute_est_ms", "rates")}
    old["rows"] = [{k: v for k, v in r.items() if k not in ("fwd_mem_bytes", "fwd_rng_bytes", "fwd_est_ms")} for r in old["rows"]]
    legacy = Plan.from_dict(old)
    assert legacy.recompute_est_ms is None and "est. ms" not in str(legacy)
    # without measured rates there is nothing to estimate with
    assert make_plan(base, "every_k", every_k=3).recompute_est_ms is None


def test_nested_search_is_coarser_when_a_single_level_plan_fits(monkeypatch):
    """The multi-level search counts memory in 1024 slots up to 48 blocks (fewer past them), and in
    a quarter as many when a single-level plan already fits, where nesting can only recompute less."""
    from lightning_ckpt.planning import policies

    assert [policies.nested_slots(n, False) for n in (8, 48, 96)] == [1024, 1024, 512]
    assert [policies.nested_slots(n, True) for n in (8, 48, 96)] == [256, 256, 128]
    seen = []
    real = policies.solve_nested

    def spy(cost, budget, metric, levels, slots):
        seen.append(slots)
        return real(cost, budget, metric, levels, slots=slots)

    monkeypatch.setattr(policies, "solve_nested", spy)
    cost = uniform(8)
    full = make_plan(cost, "full").predicted_peak_bytes
    make_plan(cost, "optimal", full + MiB)  # single-level plans fit
    with pytest.raises(InfeasibleBudgetError):
        make_plan(cost, "optimal", cost.static_bytes + MiB)  # nothing fits, nested or not
    assert seen == [256, 1024]
