"""The report's files: the plan and its profile as JSON (`REPORT_JSON`, written before the first
step), and the trade-off plot as PNG (`REPORT_PNG`, drawn by `report.plot`, on a thread of its own
when asked). The JSON leaves out the per-op records unless asked (`full=True`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.report.plot import plot_tradeoff

REPORT_JSON = "lightning_ckpt_plan.json"
REPORT_PNG = "lightning_ckpt_tradeoff.png"


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
