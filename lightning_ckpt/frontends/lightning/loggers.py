"""The plan's output through the Trainer: metrics to its loggers, report files into its log directory.

Only rank 0 logs and writes. Without a logger the report goes under the Trainer's
`default_root_dir`, never the current directory, and one info line says where.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.report.files import wait_for_plots, write_report


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """`metrics` to every logger of the Trainer at the current step, on rank 0."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def write_plan_report(
    trainer: pl.Trainer, plan: Plan, profile: Profile | None, cost: StepCost | None, metric: str, full: bool = False
) -> list[Path]:
    """Write the report on rank 0 (call it on every rank); -> the paths written (none elsewhere).
    `full`: the JSON keeps every block's per-op records (`report.write_json`). The JSON is written
    now; the PNG is drawn on a thread of its own while training goes on (`finish_reports`).
    A report that cannot be written is one warning, and training goes on (`report.write_report`)."""
    log_dir = trainer.log_dir  # a collective: every rank calls it
    if not trainer.is_global_zero:
        return []
    where = "the logger's directory"
    if not trainer.loggers or log_dir is None:
        log_dir, where = trainer.default_root_dir, "the Trainer's default_root_dir: there is no logger"
    paths = write_report(Path(log_dir), plan, profile, cost, metric=metric, full=full, background=True)
    if paths:
        rank_zero_info(f"lightning-ckpt: plan report written to {', '.join(map(str, paths))} (in {where})")
    return paths


def finish_reports() -> None:
    """Wait for the report PNGs still being drawn; a plot that failed is told here, once."""
    for failure in wait_for_plots():
        rank_zero_warn(f"lightning-ckpt: the trade-off plot could not be written ({failure}); the JSON report is complete and training went on.")
