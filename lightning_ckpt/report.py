"""The plan report: JSON of the plan and its profile, and the memory/recompute trade-off plot.

The curve is the optimal plan's recompute at every budget between the `full` and `none` peaks, with the
multi-level curve below the `full` peak (segments rebuilt inside segments), the fixed policies, the chosen
plan and the budget marked. `plan_summary` and `plan_metrics` are what the
callback prints and logs. matplotlib is imported only here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lightning_ckpt.planning.costs import StepCost
from lightning_ckpt.planning.linear_fit import Profile
from lightning_ckpt.planning.memory_model import base_bytes, end_need, gradients_after, optimizer_need
from lightning_ckpt.planning.nested_model import depth_of
from lightning_ckpt.planning.plan import Plan, format_bytes
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan

REPORT_JSON = "lightning_ckpt_plan.json"
REPORT_PNG = "lightning_ckpt_tradeoff.png"


@dataclass(frozen=True)
class TradeoffPoint:
    label: str
    peak_bytes: int
    recompute_flops: int
    recompute_cost: float  # in the plot's metric: GFLOP for `flops`, ms for `time` and `ms`


def _cost_of(plan: Plan, metric: str) -> float:
    """A plan's recompute in the unit the plot shows for `metric`."""
    if metric == "time" and plan.recompute_est_ms is not None:
        return plan.recompute_est_ms
    if metric == "ms":
        return plan.recompute_ms
    return plan.recompute_flops / 1e9


def _axis_label(metric: str) -> str:
    return {
        "time": "estimated recompute time (ms per step)",
        "ms": "recompute time, forward timed once (ms per step)",
    }.get(metric, "recomputed forward (GFLOP per step)")


def tradeoff_curve(cost: StepCost, points: int = 16, metric: str = "flops", max_levels: int = 1) -> list[TradeoffPoint]:
    """The optimal plan at `points` budgets: single-level (`max_levels` = 1) from the `full`
    peak to the `none` peak; multi-level from the step's floor (parameters, gradients,
    optimizer state, batch, and the largest backward of any block) to the `full` peak, where
    nesting is what fits."""
    full = make_plan(cost, "full").predicted_peak_bytes
    none = make_plan(cost, "none").predicted_peak_bytes
    if max_levels > 1:
        # [bound] whatever the nesting, each block's backward holds its rebuilt activations, the
        # gradients of later blocks and of its output, and its scratch, on top of the base bytes
        after = gradients_after(cost)
        lo = max(
            [optimizer_need(cost), end_need(cost)]
            + [base_bytes(cost) + b.saved_bytes + after[i] + b.output_bytes + b.bwd_transient_bytes
               for i, b in enumerate(cost.blocks)]
        )
        hi = min(full, none)
    else:
        lo, hi = min(full, none), none
    label = "optimal" if max_levels == 1 else f"multi-level ({max_levels})"
    out: list[TradeoffPoint] = []
    for k in range(points):
        budget = int(lo + (hi - lo) * k / max(1, points - 1))
        try:
            plan = make_plan(cost, "optimal", budget, metric=metric, max_levels=max_levels)
        except InfeasibleBudgetError:
            continue
        out.append(TradeoffPoint(label, plan.predicted_peak_bytes, plan.recompute_flops, _cost_of(plan, metric)))
    return out


def baseline_points(cost: StepCost, metric: str = "flops") -> list[TradeoffPoint]:
    pts = []
    for policy, k in (("none", None), ("full", None), ("sqrt", None), ("every_k", 2), ("every_k", 4)):
        plan = make_plan(cost, policy, None, every_k=k, metric=metric)
        label = policy if k is None else f"every_{k}"
        pts.append(TradeoffPoint(label, plan.predicted_peak_bytes, plan.recompute_flops, _cost_of(plan, metric)))
    return pts


def write_json(path: str | Path, plan: Plan, profile: Profile | None = None, cost: StepCost | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "plan": plan.to_dict(),
        "profile": None if profile is None else profile.to_dict(),
        "cost": None if cost is None else cost.to_dict(),
    }
    path.write_text(json.dumps(data, indent=2))
    return path


def plan_summary(plan: Plan) -> str:
    """The plan's table, or one line saying that nothing needs checkpointing."""
    if plan.segments:
        return str(plan)
    return (
        f"lightning-ckpt: nothing to checkpoint: batch {plan.batch_size} is predicted to peak at "
        f"{format_bytes(plan.predicted_peak_bytes)} without checkpointing, within the budget of "
        f"{format_bytes(plan.budget_bytes or 0)}. Training runs unchanged."
    )


def plan_metrics(plan: Plan) -> dict[str, float]:
    """What the callback logs about its plan, under the `ckpt/` prefix."""
    return {
        "ckpt/predicted_peak_bytes": float(plan.predicted_peak_bytes),
        "ckpt/recompute_share": float(plan.recompute_share),
        "ckpt/checkpointed_blocks": float(len(plan.checkpointed)),
    }


def write_report(
    directory: str | Path, plan: Plan, profile: Profile | None, cost: StepCost | None, metric: str = "flops"
) -> list[Path]:
    """Write `REPORT_JSON` into `directory`, and `REPORT_PNG` when the step's cost is known (a
    plan resumed from a checkpoint may come without it); -> the paths written."""
    directory = Path(directory)
    paths = [write_json(directory / REPORT_JSON, plan, profile, cost)]
    if cost is not None:
        paths.append(plot_tradeoff(directory / REPORT_PNG, cost, plan, metric=metric))
    return paths


def plot_tradeoff(path: str | Path, cost: StepCost, plan: Plan, points: int = 16, metric: str = "flops") -> Path:
    """Write the trade-off PNG; returns its path."""
    import matplotlib.pyplot as plt

    fig = tradeoff_figure(cost, plan, points, metric)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def tradeoff_figure(cost: StepCost, plan: Plan, points: int = 16, metric: str = "flops"):
    """The trade-off plot as a matplotlib figure (optimal curve, baselines, chosen plan, budget)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("the plan plot needs matplotlib: pip install matplotlib") from err

    mib = 2**20
    curve = tradeoff_curve(cost, points, metric)
    levels = max(2, depth_of(plan.segments, plan.inner_segments))
    nested = tradeoff_curve(cost, max(4, points // 2), metric, max_levels=levels)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    if curve:
        ax.step(
            [p.peak_bytes / mib for p in curve], [p.recompute_cost for p in curve],
            where="post", color="tab:blue", label="optimal plan at each budget",
        )
    if nested:
        ax.plot(
            [p.peak_bytes / mib for p in nested], [p.recompute_cost for p in nested], "o--", markersize=3,
            color="tab:green", label=f"multi-level plans (up to {levels} levels), below the full peak",
        )
    for i, pt in enumerate(baseline_points(cost, metric)):
        ax.scatter(pt.peak_bytes / mib, pt.recompute_cost, marker="s", s=30, zorder=3)
        # baselines that all recompute everything sit on one line: stagger their labels
        ax.annotate(
            pt.label, (pt.peak_bytes / mib, pt.recompute_cost), textcoords="offset points",
            xytext=(4, -12 - 10 * i), fontsize=8,
        )
    ax.scatter(
        plan.predicted_peak_bytes / mib, _cost_of(plan, metric), marker="*", s=220, color="tab:red", zorder=4,
        label=f"chosen: {plan.policy}",
    )
    if plan.budget_bytes is not None:
        ax.axvline(plan.budget_bytes / mib, color="tab:red", linestyle="--", label="memory budget")
    ax.set_xlabel("predicted peak memory of a step (MiB)")
    ax.set_ylabel(_axis_label(metric))
    ax.set_title(f"lightning-ckpt: memory vs recompute at batch {plan.batch_size}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
