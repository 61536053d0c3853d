"""The report's files: the plan and its profile as JSON (`REPORT_JSON`, written before the first
step), and the trade-off plot as PNG (`REPORT_PNG`, drawn by `report.plot`, on a thread of its own
when asked). The JSON leaves out the per-op records unless asked (`full=True`). Each file is
written whole or not at all (a temporary file beside it, then renamed over it: a symlink there is
replaced, never written through), and `write_report` turns a file it cannot write into one warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Callable
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
    read either form back. The file is written whole (`write_whole`): an `OSError` leaves what
    was there before and no partial file."""
    path = Path(path)

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
    text = json.dumps(data, indent=2)
    return write_whole(path, lambda tmp: tmp.write_text(text))


def write_whole(path: str | Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a temporary file beside `path`, flushed to disk, then renamed over `path`;
    -> `path`. Either the whole new file is there or what was there before: on any error the
    temporary file is removed and the error raised. A symlink at `path` is replaced by the file,
    the file it pointed to is left as it was (a rename replaces the link, it does not follow it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself on disk; not every file system allows it
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def write_report(
    directory: str | Path, plan: Plan, profile: Profile | None, cost: StepCost | None, metric: str = "flops",
    full: bool = False, background: bool = False,
) -> list[Path]:
    """Write `REPORT_JSON` into `directory` (with every block's per-op records when `full`), and
    `REPORT_PNG` when the step's cost is known (a plan resumed from a checkpoint may come without
    it); -> the paths written. With `background` the PNG (its curves planned, then drawn: 0.4-0.8 s
    at 48 blocks on one CPU thread) is made on a thread of its own, off the training step's path; `wait_for_plots`
    waits for it (the callback does at the end of fit, and the process at exit).

    The report never stops training: a file that cannot be written (a folder that cannot be
    made or written, a full disk, a file size limit) is one warning naming it and the error, and
    is left out of the paths; no partial file stays behind. When the JSON cannot be written the
    PNG is not tried."""
    directory = Path(directory)
    json_path = directory / REPORT_JSON
    try:
        paths = [write_json(json_path, plan, profile, cost, full=full)]
    except OSError as err:
        _tell_unwritten(json_path, err)
        return []
    if cost is not None:
        png = directory / REPORT_PNG
        if background:
            thread = threading.Thread(target=_plot_or_keep_error, args=(png, cost, plan, metric), name="lightning-ckpt-plot")
            _PENDING.append(thread)
            thread.start()
        else:
            try:
                _plot_whole(png, cost, plan, metric)
            except OSError as err:
                _tell_unwritten(png, err)
                return paths
        paths.append(png)
    return paths


def _tell_unwritten(path: Path, err: OSError) -> None:
    warnings.warn(
        f"lightning-ckpt: the plan report could not be written to {path} ({type(err).__name__}: {err}); "
        "training goes on without it. Point the logger (or the Trainer's default_root_dir) at a writable "
        "folder with free space to get it.",
        stacklevel=3,
    )


def _plot_whole(path: Path, cost: StepCost, plan: Plan, metric: str) -> Path:
    """The trade-off PNG, written whole (`write_whole`)."""
    return write_whole(path, lambda tmp: plot_tradeoff(tmp, cost, plan, metric=metric))


_PENDING: list[threading.Thread] = []
_FAILED: list[str] = []


def _plot_or_keep_error(path: Path, cost: StepCost, plan: Plan, metric: str) -> None:
    try:
        _plot_whole(path, cost, plan, metric)
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
