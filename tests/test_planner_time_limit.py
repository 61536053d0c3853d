"""The chain planner under a time limit: the best plan found, with a proven lower bound."""

from __future__ import annotations

import itertools
import random
import types

import pytest
from test_chain_planner import NS_RATES, rich_cost, with_work
from test_op_options import with_ops
from test_policies import random_cost

from lightning_ckpt.planning import chain_planner
from lightning_ckpt.planning.chain_planner import solve_chain
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.planning.op_options import validate_keeps
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import make_plan
from lightning_ckpt.planning.recompute_cost import recompute_cost


def jittered_encoder(n: int, seed: int, jitter: float = 0.05) -> StepCost:
    """Encoder-like blocks (benchmarks/chain_planner.py's ENCODER_BLOCK), every size and
    FLOP count jittered by up to +-`jitter`: near ties everywhere, the planner's hard case."""
    rng = random.Random(seed)

    def j(v: int) -> int:
        return int(v * (1 + rng.uniform(-jitter, jitter)))

    blocks = []
    for i in range(n):
        x = j(1048576)
        blocks.append(BlockCost(
            f"block{i}", saved_bytes=max(j(31490048), x), input_bytes=x, input_saved_bytes=x, output_bytes=j(1048576),
            fwd_transient_bytes=j(1048576), bwd_transient_bytes=j(4456960), grad_bytes=j(793088), fwd_flops=j(939524096),
        ))
    return StepCost(blocks=tuple(blocks), batch_size=16, static_bytes=3 * 793088 * n + 20_000_000,
                    outside_grad_bytes=330768, pre_saved_bytes=1048576, post_saved_bytes=3165208,
                    optimizer_transient_bytes=524288)


@pytest.mark.parametrize("frac", [0.25, 0.75])
def test_time_limited_plan_fits_and_its_bound_holds(frac, monkeypatch):
    cost = jittered_encoder(160, seed=7)
    full = predict_peak(cost, [(i, i) for i in range(cost.n_blocks)]).peak_bytes
    none = predict_peak(cost, []).peak_bytes
    budget = int(full + frac * (none - full))
    exact = solve_chain(cost, budget, "flops")
    counting_clock(monkeypatch)
    quick = solve_chain(cost, budget, "flops", time_limit_s=0.0)  # stops after its first position
    assert exact.lower_bound is None and exact.gap == 0.0
    assert quick.lower_bound is not None
    assert quick.lower_bound <= exact.cost <= quick.cost
    assert 0.0 <= quick.gap < 0.05
    assert predict_peak(cost, quick.segments).peak_bytes == quick.peak_bytes <= budget
    assert recompute_cost(cost, quick.segments) == quick.cost


def test_a_generous_limit_changes_nothing(monkeypatch):
    cost = jittered_encoder(40, seed=3)
    budget = predict_peak(cost, [(i, i) for i in range(40)]).peak_bytes + 10 * 31490048
    frozen_clock(monkeypatch)
    assert solve_chain(cost, budget, "flops", time_limit_s=60.0) == solve_chain(cost, budget, "flops")


def budget_between(rng: random.Random, cost: StepCost) -> int:
    full = predict_peak(cost, [(i, i) for i in range(cost.n_blocks)]).peak_bytes
    none = predict_peak(cost, []).peak_bytes
    return int(min(full, none) + rng.random() * abs(none - full))


def frozen_clock(monkeypatch) -> None:
    """The planner's clock stands still: no time limit is ever reached, however loaded the machine
    (how long a search takes is benchmarks/chain_planner.py's measurement, not a test's)."""
    monkeypatch.setattr(chain_planner, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))


def counting_clock(monkeypatch) -> None:
    """The planner's clock ticks once per look: `time_limit_s=k` stops it at its k-th look."""
    ticks = itertools.count()
    monkeypatch.setattr(chain_planner, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))


def chain_for(seed: int) -> tuple[StepCost, str, str]:
    """Small and medium chains of every kind: jittered encoders, heterogeneous blocks with
    every overlap field, op-level options, estimated times."""
    rng = random.Random(seed)
    kind = seed % 4
    if kind == 0:
        return jittered_encoder(rng.randint(20, 140), seed=seed), "flops", "block"
    if kind == 1:
        return random_cost(rng, rng.randint(5, 60)), "flops", "block"
    if kind == 2:
        return with_ops(rng, random_cost(rng, rng.randint(3, 30)), 4), "flops", "op"
    return with_work(rng, rich_cost(rng, rng.randint(5, 50), huge=False), NS_RATES), "time", "block"


@pytest.mark.parametrize("seed", range(48))
def test_the_bound_holds_wherever_the_limit_stops_the_search(seed, monkeypatch):
    """Stopped at any look (in any capped run), the plan fits and costs what it says, and
    the proven lower bound is never above the optimum; never stopped, the plan is exact."""
    cost, metric, granularity = chain_for(seed)
    rng = random.Random(seed)
    budget = budget_between(rng, cost)
    exact = solve_chain(cost, budget, metric, granularity=granularity, beam=3)
    counting_clock(monkeypatch)
    for limit in sorted({0, 1, 2, rng.randint(3, 40), rng.randint(40, 400), 10**9}):
        quick = solve_chain(cost, budget, metric, granularity=granularity, beam=3, time_limit_s=limit)
        if exact is None:
            assert quick is None
            continue
        keeps = validate_keeps(cost, quick.segments, quick.keeps)
        assert predict_peak(cost, quick.segments, keeps).peak_bytes == quick.peak_bytes <= budget
        assert recompute_cost(cost, quick.segments, metric, keeps) == pytest.approx(quick.cost, rel=1e-12, abs=1e-12)
        if quick.lower_bound is None:
            assert (quick.cost, quick.peak_bytes) == (exact.cost, exact.peak_bytes)
        else:
            assert quick.lower_bound <= exact.cost * (1 + 1e-12) + 1e-9 and exact.cost <= quick.cost
            if quick.cost > 0:
                assert quick.gap == pytest.approx((quick.cost - quick.lower_bound) / quick.cost)


def test_the_default_limit_keeps_plans_exact_and_a_stopped_plan_says_how_close_it_is(monkeypatch):
    cost = jittered_encoder(48, seed=1)
    budget = budget_between(random.Random(0), cost)
    frozen_clock(monkeypatch)
    plan = make_plan(cost, "optimal", budget)  # the default 2 s limit, not reached
    assert plan.gap == 0.0 and "time limit" not in str(plan)
    assert plan.segments == tuple(solve_chain(cost, budget).segments)
    counting_clock(monkeypatch)
    cost = jittered_encoder(200, seed=2)
    stopped = make_plan(cost, "optimal", budget_between(random.Random(1), cost), time_limit_s=0)
    assert 0.0 < stopped.gap < 0.01
    assert f"within {100 * stopped.gap:.2g} % of the optimum (proven bound)" in str(stopped)
    assert Plan.from_dict(stopped.to_dict()) == stopped
    assert Plan.from_dict({k: v for k, v in stopped.to_dict().items() if k != "gap"}).gap == 0.0
