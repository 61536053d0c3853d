"""The run behind `python -m lightning_ckpt plan`: LightningCLI builds it, the callback plans, it stops.

The config's `ActivationCheckpointing` runs with `plan_only=True`: the Trainer does its normal
set-up up to the first batch, the callback profiles, plans, writes its report and raises
`PlanOnly` before any optimizer step.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

from lightning_ckpt.integrations.callback import ActivationCheckpointing, PlanOnly


def plan_preview(config: list[str], overrides: list[str]) -> tuple[ActivationCheckpointing, pl.Trainer] | None:
    """Build the run from the configs and overrides, plan on its first batch, stop: -> (callback,
    trainer), or None when the config has no `ActivationCheckpointing`."""
    args = [a for c in config for a in ("--config", c)] + overrides
    cli = LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=args,
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
