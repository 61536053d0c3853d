"""Plan report: JSON, trade-off plot, and what the callback writes."""

from __future__ import annotations

import dataclasses
import json

import matplotlib.image as mpimg
import numpy as np
import pytest
from test_capacity import cost_at

from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.planning.memory_model import peak_floor_bytes, predict_peak
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan
import lightning_ckpt.report.files as report
from lightning_ckpt.report.files import REPORT_PNG, wait_for_plots, write_json, write_report
from lightning_ckpt.report.plot import plot_tradeoff, tradeoff_figure
from lightning_ckpt.report.tradeoff import tradeoff_curve


def test_curve_is_monotone_and_between_full_and_none():
    cost = cost_at(8)
    curve = tradeoff_curve(cost, points=12)
    assert len(curve) >= 2
    peaks = [p.peak_bytes for p in curve]
    recompute = [p.recompute_flops for p in curve]
    # more memory never costs more recompute
    order = sorted(range(len(curve)), key=lambda i: peaks[i])
    assert all(recompute[order[i]] >= recompute[order[i + 1]] for i in range(len(order) - 1))
    assert max(peaks) <= make_plan(cost, "none").predicted_peak_bytes


def test_json_and_png_written_and_plot_marks_budget_and_choice(tmp_path):
    cost = cost_at(8)
    budget = (make_plan(cost, "none").predicted_peak_bytes + make_plan(cost, "full").predicted_peak_bytes) // 2
    plan = make_plan(cost, "optimal", budget)
    js = write_json(tmp_path / "plan.json", plan, cost=cost)
    data = json.loads(js.read_text())
    assert data["plan"]["segments"] == [list(s) for s in plan.segments]
    png = plot_tradeoff(tmp_path / "plot.png", cost, plan)
    img = mpimg.imread(png)
    assert img.shape[0] >= 300 and img.shape[1] >= 500
    fig = tradeoff_figure(cost, plan)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "memory budget" in labels and "chosen: optimal" in labels
    assert any(line.get_xdata()[0] == budget / 2**20 for line in fig.axes[0].lines if line.get_linestyle() == "--")


def test_a_plot_drawn_in_the_background_is_the_plot_drawn_in_place(tmp_path, monkeypatch):
    cost = cost_at(8)
    plan = make_plan(cost, "optimal", (make_plan(cost, "none").predicted_peak_bytes + make_plan(cost, "full").predicted_peak_bytes) // 2)
    here = write_report(tmp_path / "here", plan, None, cost)
    later = write_report(tmp_path / "later", plan, None, cost, background=True)
    assert [p.name for p in later] == [p.name for p in here] and later[-1].name == REPORT_PNG
    assert wait_for_plots() == []
    assert np.array_equal(mpimg.imread(here[-1]), mpimg.imread(later[-1]))

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(report, "plot_tradeoff", broken)
    write_report(tmp_path / "broken", plan, None, cost, background=True)
    failed = wait_for_plots()
    assert len(failed) == 1 and "RuntimeError: no fonts" in failed[0] and REPORT_PNG in failed[0]
    assert wait_for_plots() == []  # told once
    assert (tmp_path / "broken" / report.REPORT_JSON).exists()


def test_plot_axis_follows_the_cost_metric(tmp_path):
    """With cost_metric='time' the curve and the chosen plan are in estimated ms, not GFLOP."""
    from lightning_ckpt.costs.block_costs import StepCost
    from lightning_ckpt.costs.machine_rates import MachineRates

    cost = cost_at(8)
    rates = MachineRates(flop_per_s=1e11, mem_byte_per_s=1e10, rng_byte_per_s=1e9)
    cost = StepCost(**{**cost.__dict__, "meta": {**cost.meta, "rates": rates.to_dict()}})
    budget = (make_plan(cost, "none").predicted_peak_bytes + make_plan(cost, "full").predicted_peak_bytes) // 2
    plan = make_plan(cost, "optimal", budget, metric="time")
    curve = tradeoff_curve(cost, points=8, metric="time")
    assert curve and all(p.recompute_cost >= 0 for p in curve)
    # the full plan's point on the time axis is its estimated recompute in ms
    full = make_plan(cost, "full", metric="time")
    assert full.recompute_est_ms is not None and full.recompute_est_ms > 0
    fig = tradeoff_figure(cost, plan, points=8, metric="time")
    assert fig.axes[0].get_ylabel() == "estimated recompute time (ms per step)"
    star = next(c for c in fig.axes[0].collections if c.get_label() == "chosen: optimal")
    assert star.get_offsets()[0][1] == plan.recompute_est_ms
    assert tradeoff_figure(cost, plan, points=8).axes[0].get_ylabel() == "recomputed forward (GFLOP per step)"


def test_callback_without_logger_writes_report_under_default_root_dir(tmp_path, monkeypatch, caplog):
    """logger=False: both files go under the Trainer's default_root_dir, nothing into the cwd, and one
    info line says where."""
    import logging

    import lightning.pytorch as pl
    from lit_models import LitChain, TokenData

    from lightning_ckpt import ActivationCheckpointing
    from lightning_ckpt.report.files import REPORT_JSON, REPORT_PNG

    root, cwd = tmp_path / "root", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="full", verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, callbacks=[cb], logger=False, default_root_dir=root, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(LitChain(), datamodule=TokenData(batch_size=8))
    assert sorted(cb.report_paths) == [root / REPORT_JSON, root / REPORT_PNG]
    assert all(p.stat().st_size > 1000 for p in cb.report_paths)
    assert list(cwd.iterdir()) == []
    lines = [r.getMessage() for r in caplog.records if "plan report written" in r.getMessage()]
    assert len(lines) == 1 and str(root / REPORT_JSON) in lines[0] and "default_root_dir" in lines[0]


def test_write_report_without_cost_writes_only_the_json(tmp_path):
    """A plan resumed without its cost has no curve to draw: the JSON alone is written."""
    from lightning_ckpt.report.files import REPORT_JSON, REPORT_PNG, write_report

    cost = cost_at(8)
    plan = make_plan(cost, "full")
    assert write_report(tmp_path / "a", plan, None, None) == [tmp_path / "a" / REPORT_JSON]
    assert write_report(tmp_path / "b", plan, None, cost) == [tmp_path / "b" / REPORT_JSON, tmp_path / "b" / REPORT_PNG]
    assert json.loads((tmp_path / "a" / REPORT_JSON).read_text())["cost"] is None


def interior_chain(n: int = 8, b: int = 8) -> StepCost:
    """`cost_at`'s blocks (each saves 20x its input), `n` of them: nesting reaches below `full`'s peak."""
    return StepCost(blocks=cost_at(b).blocks[:1] * n, batch_size=b, static_bytes=1000)


def test_multi_level_curve_reaches_below_every_single_level_plan():
    """Points under the lowest single-level peak come only from plans with inner segments; each
    such point's plan fits its peak as a budget, which nothing single-level does."""
    cost = interior_chain()
    full = make_plan(cost, "full").predicted_peak_bytes
    single = tradeoff_curve(cost, points=12)
    multi = tradeoff_curve(cost, points=12, max_levels=2)
    lowest = min(p.peak_bytes for p in single)
    below = [p for p in multi if p.peak_bytes < lowest]
    assert below and lowest == full and max(p.peak_bytes for p in multi) <= full
    assert all(p.label == "multi-level (2)" for p in multi) and all(p.label == "optimal" for p in single)
    for p in below:
        plan = make_plan(cost, "optimal", p.peak_bytes, max_levels=2)
        assert plan.fits and plan.inner_segments and plan.recompute_flops == p.recompute_flops
        with pytest.raises(InfeasibleBudgetError, match=r"max_levels=1"):
            make_plan(cost, "optimal", p.peak_bytes, max_levels=1)


def unet_chain(b: int = 8) -> StepCost:
    """A U-Net-like chain: four blocks down, four up. The output of down block k is the skip its
    mirror up block reads: carried across the blocks between them (`carried_fwd_bytes`, and twice
    that in backward, with its gradient)."""
    acts = [40 * b, 30 * b, 20 * b, 10 * b]  # the outputs of the down blocks
    n = 2 * len(acts)
    outs = [acts[min(i, n - 1 - i)] for i in range(n)]
    blocks = []
    for i, out in enumerate(outs):
        x = outs[i - 1] if i else acts[0]
        skips = sum(acts[k] for k in range(len(acts)) if k < i < n - 1 - k)
        blocks.append(BlockCost(
            f"{'down' if i < len(acts) else 'up'}{i}", saved_bytes=2 * out, input_bytes=x, input_saved_bytes=x,
            output_bytes=out, fwd_transient_bytes=out, bwd_transient_bytes=out, grad_bytes=50, fwd_flops=100 * out,
            carried_fwd_bytes=skips, carried_bwd_bytes=2 * skips,
        ))
    return StepCost(blocks=tuple(blocks), batch_size=b, static_bytes=1000, outside_grad_bytes=20)


@pytest.mark.parametrize("max_levels", [1, 2])
def test_curve_points_are_their_plans_and_start_at_the_models_floor(monkeypatch, max_levels):
    """On a chain with carried storages, the multi-level curve starts at the memory model's floor
    (`peak_floor_bytes`, which counts them), and every point's peak is `predict_peak` of the plan it
    came from, within that plan's budget."""
    import lightning_ckpt.report.tradeoff as tradeoff

    cost = unet_chain()
    assert any(b.carried_bwd_bytes for b in cost.blocks)
    budgets, plans = [], []
    solve = tradeoff.solve_nested_levels

    def solve_spy(c, asked, *args, **kwargs):
        budgets.extend(asked)
        return solve(c, asked, *args, **kwargs)

    def plan_spy(build):
        def spy(*args, **kwargs):
            plan = build(*args, **kwargs)
            if plan.budget_bytes is not None:  # `full` and `none` set the range, they are no points
                plans.append(plan)
            return plan

        return spy

    monkeypatch.setattr(tradeoff, "solve_nested_levels", solve_spy)
    monkeypatch.setattr(tradeoff, "make_plan", plan_spy(tradeoff.make_plan))
    monkeypatch.setattr(tradeoff, "build_plan", plan_spy(tradeoff.build_plan))
    curve = tradeoff_curve(cost, points=12, max_levels=max_levels)
    floor = peak_floor_bytes(cost)
    if max_levels > 1:
        assert budgets[0] == floor, (budgets[0], floor)
        assert any(plan.inner_segments for plan in plans)
    assert curve and len(plans) == len(curve)
    for point, plan in zip(curve, plans):
        model = predict_peak(cost, plan.segments, plan.keep_ops or None, plan.inner_segments).peak_bytes
        assert point.peak_bytes == plan.predicted_peak_bytes == model
        assert floor <= model <= plan.budget_bytes


@pytest.mark.parametrize("n_blocks", [4, 8])
def test_figure_draws_the_multi_level_curve_below_the_full_peak(n_blocks):
    """At the plot's default density the multi-level line has a point where only nested plans fit
    (on 4 blocks only the last 40 bytes under `full`'s peak fit them, of the 960 from the step's floor)."""
    cost = interior_chain(n_blocks)
    full = make_plan(cost, "full").predicted_peak_bytes
    plan = make_plan(cost, "optimal", full - 1)
    assert plan.inner_segments
    fig = tradeoff_figure(cost, plan)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "multi-level plans (up to 2 levels), below the full peak" in labels
    lines = [ln for ln in fig.axes[0].lines if ln.get_label().startswith("multi-level plans")]
    assert len(lines) == 1
    assert min(lines[0].get_xdata()) < full / 2**20


def _with_ops(cost: StepCost) -> StepCost:
    from lightning_ckpt.costs.block_costs import OpCost

    ops = tuple(OpCost(op="aten.mm.default", call_index=k, keep_bytes=64, saved=True, keepable=True) for k in range(3))
    return dataclasses.replace(cost, blocks=tuple(dataclasses.replace(b, ops=ops) for b in cost.blocks))


def test_json_leaves_the_per_op_records_out_unless_asked(tmp_path):
    """By default the JSON has every block's costs but not its per-op records (most of the bytes on
    a real model); `full=True` keeps them. Both forms read back with `from_dict`."""
    from lightning_ckpt.costs.linear_fit import Profile

    cost = _with_ops(cost_at(8))
    profile = Profile(probes=(_with_ops(cost_at(1)), _with_ops(cost_at(2))), check=_with_ops(cost_at(4)))
    plan = make_plan(cost, "full")
    small = json.loads(write_json(tmp_path / "small.json", plan, profile, cost).read_text())
    full = json.loads(write_json(tmp_path / "full.json", plan, profile, cost, full=True).read_text())
    assert small["full"] is False and full["full"] is True
    blocks = small["cost"]["blocks"] + [b for p in (*small["profile"]["probes"], small["profile"]["check"]) for b in p["blocks"]]
    assert blocks and all("ops" not in b for b in blocks)
    assert StepCost.from_dict(small["cost"]) == dataclasses.replace(
        cost, blocks=tuple(dataclasses.replace(b, ops=()) for b in cost.blocks)
    )
    assert StepCost.from_dict(full["cost"]) == cost
    assert Profile.from_dict(full["profile"]) == profile
    assert Profile.from_dict(small["profile"]).check.blocks[0].ops == ()
    assert (tmp_path / "small.json").stat().st_size < (tmp_path / "full.json").stat().st_size


def _labels(fig):
    """(text, its anchor in pixels, the text's box, leader line or not) of each marker label."""
    from matplotlib.text import Annotation, Text

    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    out = []
    for note in ax.texts:
        assert isinstance(note, Annotation)
        note.update_positions(renderer)
        out.append((note.get_text(), ax.transData.transform(note.xy), Text.get_window_extent(note, renderer),
                    note.arrow_patch is not None))
    return out


def _gap(box, point) -> float:
    x, y = point
    return float(np.hypot(max(box.x0 - x, 0.0, x - box.x1), max(box.y0 - y, 0.0, y - box.y1)))


@pytest.mark.parametrize("n_blocks", [4, 8, 48])
def test_every_baseline_is_labelled_at_its_marker(n_blocks):
    """Each baseline's label is anchored at its marker and lies beside it (within a few points), or,
    when the markers crowd, on a leader line; no two labels overlap; markers at one point share a label."""
    from lightning_ckpt.report.tradeoff import baseline_points

    cost = StepCost(blocks=cost_at(8).blocks[:1] * n_blocks, batch_size=8, static_bytes=1000)
    budget = (make_plan(cost, "none").predicted_peak_bytes + make_plan(cost, "full").predicted_peak_bytes) // 2
    plan = make_plan(cost, "optimal", budget)
    fig = tradeoff_figure(cost, plan)
    ax = fig.axes[0]
    labels = _labels(fig)
    named = sorted(name for text, *_ in labels for name in text.split(", "))
    assert named == sorted(p.label for p in baseline_points(cost))
    mib = 2**20
    marker = {p.label: ax.transData.transform((p.peak_bytes / mib, p.recompute_cost)) for p in baseline_points(cost)}
    for text, anchor, box, leader in labels:
        first = text.split(", ")[0]
        assert tuple(anchor) == pytest.approx(tuple(marker[first]))
        assert _gap(box, anchor) <= (130 if leader else 15), (text, _gap(box, anchor))
    boxes = [box for *_, box, _ in labels]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
