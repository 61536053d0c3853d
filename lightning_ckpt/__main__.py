"""Command line: preview a plan from a LightningCLI config without training.

    python -m lightning_ckpt plan --config configs/encoder48.yaml

The config is read by `LightningCLI` (model and data given by `class_path`), the
trainer runs its normal set-up up to the first batch, the `ActivationCheckpointing`
callback from the config profiles and plans, and the run stops before any
optimizer step: the plan table is printed and the JSON and plot are written.
"""

from __future__ import annotations

import argparse
import sys


def preview(config: list[str], overrides: list[str]):
    """Build the run from the config, plan on its first batch, stop: -> (callback, trainer) or None."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    from lightning_ckpt.integrations.callback import ActivationCheckpointing, PlanOnly

    args = [a for c in config for a in ("--config", c)] + overrides
    cli = LightningCLI(
        LightningModule,
        LightningDataModule,
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


def _preview(config: list[str], overrides: list[str]) -> int:
    found = preview(config, overrides)
    if found is None:
        print(
            f"error: the config {config} has no lightning_ckpt.ActivationCheckpointing under trainer.callbacks, "
            "so there is nothing to plan. Add it (see configs/encoder48.yaml).",
            file=sys.stderr,
        )
        return 2
    cb, _ = found
    if cb.plan is None:  # pragma: no cover - fit ended before the first batch
        print("error: training ended before the first batch, so no plan was made.", file=sys.stderr)
        return 1
    print(cb.plan)
    for path in getattr(cb, "report_paths", []):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="profile and plan from a LightningCLI config, print the plan, write the report")
    plan.add_argument("--config", action="append", required=True, help="LightningCLI YAML config (repeatable)")
    args, overrides = parser.parse_known_args(argv)
    if args.command == "plan":
        return _preview(args.config, overrides)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    raise SystemExit(main())
