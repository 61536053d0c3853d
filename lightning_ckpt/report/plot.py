"""The trade-off plot: the optimal curve (and the multi-level one below the `full` peak), the fixed
policies labelled at their markers, the chosen plan and the budget. matplotlib is imported only here,
and only its object API (`Figure`, no pyplot state), so a plot may be drawn on any thread.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.nested_model import depth_of
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.report.tradeoff import TradeoffPoint, baseline_points, cost_of, tradeoff_curve


def _axis_label(metric: str) -> str:
    return {
        "time": "estimated recompute time (ms per step)",
        "ms": "recompute time, forward timed once (ms per step)",
    }.get(metric, "recomputed forward (GFLOP per step)")


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
    chosen = (plan.predicted_peak_bytes / mib, cost_of(plan, metric))
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
