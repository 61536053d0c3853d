"""A step's profile as the planner needs it: measured by the profiling stage, then, for op-level
plans, completed by what keeping op outputs saves, which can only be measured by applying
(`apply.keep_calibration`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_ckpt.apply.keep_calibration import calibrated_profile
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.profiling.profiler import StepFn, measure_profile


def profile_model(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: StepFn,
    batch: Any,
    probe_batch_sizes: tuple[int, int] = (1, 2),
    check_batch_size: int | None = 4,
    names: Sequence[str] | None = None,
    timing: bool = True,
    rates: MachineRates | None = None,
    calibrate_keeps: bool = True,
    time_blocks: bool = True,
) -> Profile:
    """Probe at two small slices of `batch` (and check on a third) -> `Profile`
    (`profiling.profiler.measure_profile`, whose arguments these are).

    With `timing` and `calibrate_keeps`, each distinct block with op calls to keep is then timed
    alone on the whole `batch`, keeping them and not (`apply.keep_calibration`, a few block steps
    each): only op-level plans read it. Rates given in `rates` stay as given; measured ones are
    fitted to the measured recompute.
    """
    profile = measure_profile(
        model, blocks, step_fn, batch, probe_batch_sizes, check_batch_size, names=names, timing=timing,
        rates=rates, time_blocks=time_blocks,
    )
    if timing and calibrate_keeps:  # after the rates: the calibration fits them to measured recompute
        profile = calibrated_profile(profile, model, blocks, step_fn, batch, fit_rates=rates is None)
    return profile
