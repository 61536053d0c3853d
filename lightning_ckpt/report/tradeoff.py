"""The memory/recompute trade-off of a step, as data: the optimal plan's recompute at budgets from
the `full` peak to the `none` peak (single-level), or from the step's floor to the `full` peak
(multi-level, from one solve), and the fixed policies as points. Drawn by `report.plot`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.memory_model import peak_floor_bytes
from lightning_ckpt.planning.nested_planner import NESTED_MAX_BLOCKS, solve_nested_levels
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import InfeasibleBudgetError, build_plan, make_plan


@dataclass(frozen=True)
class TradeoffPoint:
    label: str
    peak_bytes: int
    recompute_flops: int
    recompute_cost: float  # in the plot's metric: GFLOP for `flops`, ms for `time` and `ms`


def cost_of(plan: Plan, metric: str) -> float:
    """A plan's recompute in the unit the plot shows for `metric`."""
    if metric == "time" and plan.recompute_est_ms is not None:
        return plan.recompute_est_ms
    if metric == "ms":
        return plan.recompute_ms
    return plan.recompute_flops / 1e9


def _curve_slots(n_blocks: int) -> int:
    """Memory slots of the multi-level curve's one solve: 1024 up to 12 blocks (one-byte slots when
    the budget is at most that many bytes above the base, as in the tests), 256 at 48 blocks (0.2 s
    of one CPU thread here), fewer on longer chains."""
    return max(128, min(1024, 256 * 48 // max(1, n_blocks)))


def tradeoff_curve(cost: StepCost, points: int = 16, metric: str = "flops", max_levels: int = 1) -> list[TradeoffPoint]:
    """The optimal plan at `points` budgets: single-level (`max_levels` = 1) from the `full`
    peak to the `none` peak; multi-level from the step's floor (`memory_model.peak_floor_bytes`:
    no plan at any nesting depth peaks lower) to the `full` peak, where nesting is what fits.
    The multi-level points come from one solve (`solve_nested_levels`: the tables of the
    largest budget hold the least recompute at every smaller one)."""
    full = make_plan(cost, "full").predicted_peak_bytes
    none = make_plan(cost, "none").predicted_peak_bytes
    if max_levels > 1:
        lo, hi = peak_floor_bytes(cost), min(full, none)
    else:
        lo, hi = min(full, none), none
    budgets = [int(lo + (hi - lo) * k / max(1, points - 1)) for k in range(points)]
    if max_levels == 1:
        out: list[TradeoffPoint] = []
        for budget in budgets:
            try:
                plan = make_plan(cost, "optimal", budget, metric=metric, max_levels=1)
            except InfeasibleBudgetError:
                continue
            out.append(TradeoffPoint("optimal", plan.predicted_peak_bytes, plan.recompute_flops, cost_of(plan, metric)))
        return out
    if not 0 < cost.n_blocks <= NESTED_MAX_BLOCKS:
        return []
    label = f"multi-level ({max_levels})"
    found = solve_nested_levels(cost, budgets, metric, max_levels, slots=_curve_slots(cost.n_blocks))
    out = []
    for budget, solution in zip(budgets, found):
        if solution is None:
            continue
        plan = build_plan(cost, solution.segments, "optimal", budget, metric, inner_segments=solution.inner)
        out.append(TradeoffPoint(label, plan.predicted_peak_bytes, plan.recompute_flops, cost_of(plan, metric)))
    return out


def baseline_points(cost: StepCost, metric: str = "flops") -> list[TradeoffPoint]:
    pts = []
    for policy, k in (("none", None), ("full", None), ("sqrt", None), ("every_k", 2), ("every_k", 4)):
        plan = make_plan(cost, policy, None, every_k=k, metric=metric)
        label = policy if k is None else f"every_{k}"
        pts.append(TradeoffPoint(label, plan.predicted_peak_bytes, plan.recompute_flops, cost_of(plan, metric)))
    return pts
