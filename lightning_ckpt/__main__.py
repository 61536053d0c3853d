"""Command line: preview a plan from a LightningCLI config without training.

`python -m lightning_ckpt plan --config configs/encoder48.yaml` builds the run with LightningCLI, lets the
config's `ActivationCheckpointing` plan on the first batch, stops before any optimizer step, prints the
plan and writes the report. lightning-ckpt's own errors (a budget nothing fits, a wrong `blocks`, a bad
argument) are printed as one line, `error: <message>`, with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def preview(config: list[str], overrides: list[str]):
    """Build the run from the config, plan on its first batch, stop: -> (callback, trainer) or None.
    Lightning is imported only here, so `--help` stays fast."""
    from lightning_ckpt.frontends.lightning.preview import plan_preview

    return plan_preview(config, overrides)


def _own_error(error: BaseException | None) -> BaseException | None:
    """The ValueError that lightning-ckpt's own code raised, `error` or a cause of it (jsonargparse
    wraps what an `__init__` raises); None when it came from the model's or the data's code."""
    while error is not None:
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if isinstance(error, ValueError) and tb is not None:
            if Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE):
                return error
        error = error.__cause__
    return None


def _preview(config: list[str], overrides: list[str]) -> int:
    from lightning_ckpt.planning.policies import InfeasibleBudgetError

    try:
        found = preview(config, overrides)
    except (InfeasibleBudgetError, ValueError) as error:
        own = _own_error(error)
        if own is None:
            raise
        print(f"error: {own}", file=sys.stderr)
        return 2
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
    for path in cb.report_paths:
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
