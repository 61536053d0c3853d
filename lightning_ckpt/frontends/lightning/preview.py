"""The run behind `python -m lightning_ckpt plan`: LightningCLI builds it, the callback plans, it stops.

The config's `ActivationCheckpointing` runs with `plan_only=True`: the Trainer does its normal
set-up up to the first batch, the callback profiles, plans, writes its report and raises
`PlanOnly` before any optimizer step. LightningCLI reads the configs and overrides as its own
command line, as when a script calls it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

from lightning_ckpt.frontends.lightning.callback import ActivationCheckpointing, PlanOnly


def plan_preview(config: list[str], overrides: list[str]) -> tuple[ActivationCheckpointing, pl.Trainer] | None:
    """Build the run from the configs and overrides, plan on its first batch, stop: -> (callback,
    trainer), or None when the config has no `ActivationCheckpointing`."""
    args = [a for c in config for a in ("--config", c)] + overrides
    with _command_line(args):
        cli = LightningCLI(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            run=False,
            save_config_callback=None,
        )
    callbacks = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationCheckpointing)]
    if not callbacks:
        return None
    cb = callbacks[0]
    cb.plan_only, cb.verbose, cb.report = True, False, True
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    except PlanOnly:
        pass
    return cb, cli.trainer


@contextmanager
def _command_line(args: list[str]) -> Iterator[None]:
    """`sys.argv` holds `args` as LightningCLI's command line, under the preview command's name.
    LightningCLI(args=...) would warn that `plan --config ...` is on the real command line too."""
    saved = sys.argv
    sys.argv = ["python -m lightning_ckpt plan", *args]
    try:
        yield
    finally:
        sys.argv = saved
