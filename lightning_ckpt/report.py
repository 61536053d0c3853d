"""The plan report: JSON of the plan and its profile, and the memory/recompute trade-off plot.

The JSON holds the plan, the step's cost and the profile, without the per-op records unless asked
(`full=True`). The curve is the optimal plan's recompute at every budget between the `full` and
`none` peaks, with the multi-level curve below the `full` peak (segments rebuilt inside segments,
from one multi-level solve), the fixed policies labelled at their markers, the chosen plan and the
budget marked. `plan_summary` and `plan_metrics` are what the callback prints and logs.
matplotlib is imported only here.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_ckpt.planning.costs import StepCost
from lightning_ckpt.planning.linear_fit import Profile
from lightning_ckpt.planning.memory_model import base_bytes, end_need, gradients_after, optimizer_need
from lightning_ckpt.planning.nested_model import depth_of
from lightning_ckpt.planning.nested_planner import NESTED_MAX_BLOCKS, solve_nested_levels
from lightning_ckpt.planning.plan import Plan, format_bytes
from lightning_ckpt.planning.policies import InfeasibleBudgetError, build_plan, make_plan

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


def _curve_slots(n_blocks: int) -> int:
    """Memory slots of the multi-level curve's one solve: 1024 up to 12 blocks (one-byte slots when
    the budget is at most that many bytes above the base, as in the tests), 256 at 48 blocks (0.2 s
    of one CPU thread here), fewer on longer chains."""
    return max(128, min(1024, 256 * 48 // max(1, n_blocks)))


def tradeoff_curve(cost: StepCost, points: int = 16, metric: str = "flops", max_levels: int = 1) -> list[TradeoffPoint]:
    """The optimal plan at `points` budgets: single-level (`max_levels` = 1) from the `full`
    peak to the `none` peak; multi-level from the step's floor (parameters, gradients,
    optimizer state, batch, and the largest backward of any block) to the `full` peak, where
    nesting is what fits. The multi-level points come from one solve (`solve_nested_levels`:
    the tables of the largest budget hold the least recompute at every smaller one)."""
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
    budgets = [int(lo + (hi - lo) * k / max(1, points - 1)) for k in range(points)]
    if max_levels == 1:
        out: list[TradeoffPoint] = []
        for budget in budgets:
            try:
                plan = make_plan(cost, "optimal", budget, metric=metric, max_levels=1)
            except InfeasibleBudgetError:
                continue
            out.append(TradeoffPoint("optimal", plan.predicted_peak_bytes, plan.recompute_flops, _cost_of(plan, metric)))
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
        out.append(TradeoffPoint(label, plan.predicted_peak_bytes, plan.recompute_flops, _cost_of(plan, metric)))
    return out


def baseline_points(cost: StepCost, metric: str = "flops") -> list[TradeoffPoint]:
    pts = []
    for policy, k in (("none", None), ("full", None), ("sqrt", None), ("every_k", 2), ("every_k", 4)):
        plan = make_plan(cost, policy, None, every_k=k, metric=metric)
        label = policy if k is None else f"every_{k}"
        pts.append(TradeoffPoint(label, plan.predicted_peak_bytes, plan.recompute_flops, _cost_of(plan, metric)))
    return pts


def _without_ops(cost: StepCost) -> dict:
    """`cost.to_dict()` without the per-op lists of its blocks (`BlockCost.ops`): `StepCost.from_dict`
    reads it back with no ops."""
    data = dataclasses.replace(cost, blocks=tuple(dataclasses.replace(b, ops=()) for b in cost.blocks)).to_dict()
    for block in data["blocks"]:
        del block["ops"]
    return data


def write_json(
    path: str | Path, plan: Plan, profile: Profile | None = None, cost: StepCost | None = None, full: bool = False
) -> Path:
    """Write the plan, the step's cost and the profile as JSON; -> its path.

    Without `full` the per-op records of every block (what op-level plans choose from, most of
    the bytes: 3.7 MB of the 48-block encoder's 4.0 MB) are left out of the cost and of every
    probe of the profile, and ``"full"`` says so; `StepCost.from_dict` and `Profile.from_dict`
    read either form back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def cost_dict(c: StepCost) -> dict:
        return c.to_dict() if full else _without_ops(c)

    data = {
        "plan": plan.to_dict(),
        "profile": None if profile is None else {
            "probes": [cost_dict(p) for p in profile.probes],
            "check": None if profile.check is None else cost_dict(profile.check),
        },
        "cost": None if cost is None else cost_dict(cost),
        "full": full,
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
    directory: str | Path, plan: Plan, profile: Profile | None, cost: StepCost | None, metric: str = "flops",
    full: bool = False, background: bool = False,
) -> list[Path]:
    """Write `REPORT_JSON` into `directory` (with every block's per-op records when `full`), and
    `REPORT_PNG` when the step's cost is known (a plan resumed from a checkpoint may come without
    it); -> the paths written. With `background` the PNG (its curves planned, then drawn: 0.4-0.8 s
    at 48 blocks on one CPU thread) is made on a thread of its own, off the training step's path; `wait_for_plots`
    waits for it (the callback does at the end of fit, and the process at exit)."""
    directory = Path(directory)
    paths = [write_json(directory / REPORT_JSON, plan, profile, cost, full=full)]
    if cost is not None:
        png = directory / REPORT_PNG
        if background:
            thread = threading.Thread(target=_plot_or_keep_error, args=(png, cost, plan, metric), name="lightning-ckpt-plot")
            _PENDING.append(thread)
            thread.start()
        else:
            plot_tradeoff(png, cost, plan, metric=metric)
        paths.append(png)
    return paths


_PENDING: list[threading.Thread] = []
_FAILED: list[str] = []


def _plot_or_keep_error(path: Path, cost: StepCost, plan: Plan, metric: str) -> None:
    try:
        plot_tradeoff(path, cost, plan, metric=metric)
    except Exception as err:  # told by `wait_for_plots`, on the caller's thread
        _FAILED.append(f"{path}: {type(err).__name__}: {err}")


def wait_for_plots() -> list[str]:
    """Wait for the PNGs `write_report(..., background=True)` is drawing; -> what failed, and why
    (each told once)."""
    while _PENDING:
        _PENDING.pop().join()
    failed = list(_FAILED)
    _FAILED.clear()
    return failed


def plot_tradeoff(path: str | Path, cost: StepCost, plan: Plan, points: int = 16, metric: str = "flops") -> Path:
    """Write the trade-off PNG; returns its path."""
    fig = tradeoff_figure(cost, plan, points, metric)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def tradeoff_figure(cost: StepCost, plan: Plan, points: int = 16, metric: str = "flops"):
    """The trade-off plot as a matplotlib figure (optimal curve, baselines, chosen plan, budget)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("the plan plot needs matplotlib: pip install matplotlib") from err

    mib = 2**20
    curve = tradeoff_curve(cost, points, metric)
    levels = max(2, depth_of(plan.segments, plan.inner_segments))
    nested = tradeoff_curve(cost, max(4, points // 2), metric, max_levels=levels)
    fig = Figure(figsize=(7, 5), dpi=100)  # not pyplot's: no global state, so it may be drawn on any thread
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
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
    baselines = baseline_points(cost, metric)
    colors = [f"C{k}" for k in range(len(baselines))]
    for pt, color in zip(baselines, colors):
        ax.scatter(pt.peak_bytes / mib, pt.recompute_cost, marker="s", s=30, color=color, zorder=3)
    chosen = (plan.predicted_peak_bytes / mib, _cost_of(plan, metric))
    ax.scatter(*chosen, marker="*", s=220, color="tab:red", zorder=4, label=f"chosen: {plan.policy}")
    if plan.budget_bytes is not None:
        ax.axvline(plan.budget_bytes / mib, color="tab:red", linestyle="--", label="memory budget")
    ax.set_xlabel("predicted peak memory of a step (MiB)")
    ax.set_ylabel(_axis_label(metric))
    ax.set_title(f"lightning-ckpt: memory vs recompute at batch {plan.batch_size}")
    ax.grid(alpha=0.3)
    ax.margins(x=0.06, y=0.1)  # room for the labels of markers at the edges
    # below the plot, where it hides no marker
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.tight_layout()
    _label_markers(fig, ax, baselines, colors, chosen)
    return fig


def _line_points(ax, step_px: float = 3.0) -> np.ndarray:
    """Points every `step_px` pixels along the lines drawn on `ax` (as drawn: steps included), in pixels."""
    out = []
    for line in ax.lines:
        xy = line.get_transform().transform(line.get_xydata())
        if line.get_drawstyle().startswith("steps"):
            from matplotlib.cbook import STEP_LOOKUP_MAP

            xy = np.column_stack(STEP_LOOKUP_MAP[line.get_drawstyle()](xy[:, 0], xy[:, 1]))
        for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:]):
            k = max(2, int(np.hypot(x1 - x0, y1 - y0) / step_px) + 1)
            out.append(np.column_stack((np.linspace(x0, x1, k), np.linspace(y0, y1, k))))
    return np.concatenate(out) if out else np.zeros((0, 2))


def _distance(box, point) -> float:
    """Distance in pixels from a point to a box (0 inside it)."""
    x, y = point
    return float(np.hypot(max(box.x0 - x, 0.0, x - box.x1), max(box.y0 - y, 0.0, y - box.y1)))


# where a label may go around its marker, in order: (dx, dy) in points, horizontal and vertical
# alignment; first beside it, then further up or down on a leader line
_BESIDE = (
    (6, 5, "left", "bottom"), (6, -5, "left", "top"), (-6, 5, "right", "bottom"), (-6, -5, "right", "top"),
    (0, 8, "center", "bottom"), (0, -8, "center", "top"),
)
_FURTHER = tuple(
    (dx, d * sign, "center" if dx == 0 else ("left" if dx > 0 else "right"), "bottom" if sign > 0 else "top")
    for d in range(20, 120, 12) for sign in (1, -1) for dx in (0, 12, -12)
)


def _marker_groups(centers: list, size: float) -> list[list[int]]:
    """Indices of markers that overlap on the plot (centres closer than `size` pixels on both axes)."""
    groups: list[list[int]] = []
    for k, (x, y) in enumerate(centers):
        near = next((g for g in groups if any(abs(x - centers[j][0]) < size and abs(y - centers[j][1]) < size for j in g)), None)
        if near is None:
            groups.append([k])
        else:
            near.append(k)
    return groups


def _label_markers(fig, ax, points: list[TradeoffPoint], colors: list[str], chosen: tuple[float, float]) -> None:
    """Label each baseline marker next to it, in its colour: the first spot whose text stays inside
    the axes, overlaps no other label or marker, crosses no line and, beside the marker, is nearer
    to it than to any other marker (further away a leader line ties it to its marker). Markers that
    overlap on the plot share one label."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    mib = 2**20
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    half = 4 * fig.dpi / 72  # half a marker's side in pixels (s=30: about 5.5 points)
    centers = [ax.transData.transform((p.peak_bytes / mib, p.recompute_cost)) for p in points]
    sx, sy = ax.transData.transform(chosen)
    lines = _line_points(ax)
    taken = [Bbox.from_extents(x - half, y - half, x + half, y + half) for x, y in centers]
    taken.append(Bbox.from_extents(sx - 3 * half, sy - 3 * half, sx + 3 * half, sy + 3 * half))  # the star

    def free(box, group: list[int], beside: bool) -> bool:
        inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
        own = min(_distance(box, centers[k]) for k in group)
        nearest = not beside or all(_distance(box, c) > own for j, c in enumerate(centers) if j not in group)
        crossed = np.any((lines[:, 0] >= box.x0) & (lines[:, 0] <= box.x1) & (lines[:, 1] >= box.y0) & (lines[:, 1] <= box.y1))
        return inside and nearest and not crossed and not any(box.overlaps(other) for other in taken)

    for group in sorted(_marker_groups(centers, 2 * half), key=lambda g: centers[g[0]][0]):
        group = sorted(group, key=lambda k: (points[k].peak_bytes, points[k].label))
        anchor = (points[group[0]].peak_bytes / mib, points[group[0]].recompute_cost)
        text = ", ".join(points[k].label for k in group)
        color = colors[group[0]] if len(group) == 1 else "0.2"
        for n, (dx, dy, ha, va) in enumerate((*_BESIDE, *_FURTHER, _BESIDE[0])):
            beside = n < len(_BESIDE) or n == len(_BESIDE) + len(_FURTHER)
            note = ax.annotate(
                text, anchor, textcoords="offset points", xytext=(dx, dy), ha=ha, va=va, fontsize=8, color=color,
                arrowprops=None if beside else {"arrowstyle": "-", "lw": 0.5, "color": color},
            )
            note.update_positions(renderer)
            box = Text.get_window_extent(note, renderer)  # the text alone, without its leader line
            if n == len(_BESIDE) + len(_FURTHER) or free(box, group, beside):  # the last: crowded all round
                taken.append(box)
                break
            note.remove()
