"""A step's profile as the planner needs it: measured by the profiling stage, then, for op-level
plans, completed by what keeping op outputs saves, which can only be measured by applying
(`apply.keep_calibration`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_ckpt.apply.keep_calibration import calibrated_profile
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.profiling.structure.layer_skipping import layers_always_run
from lightning_ckpt.profiling.passes.measured_profile import measure_profile
from lightning_ckpt.profiling.passes.profiler import StepFn


def profile_model(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, *args: Any,
    calibrate_keeps: bool = True, **kwargs: Any,
) -> Profile:
    """Probe at two small slices of `batch` (and check on a third) -> `Profile`: the arguments
    after `batch` are those of `profiling.passes.measured_profile.measure_profile` (`probe_batch_sizes`,
    `check_batch_size`, `names`, `timing`, `rates`, `time_blocks`).

    With `timing` and `calibrate_keeps`, each distinct block with op calls to keep is then timed
    alone on the whole `batch`, keeping them and not (`apply.keep_calibration`, a few block steps
    each, within what `budget` leaves): only op-level plans read it. Rates given in `rates` stay as given; measured ones are
    fitted to the measured recompute.
    """
    bound = inspect.signature(measure_profile).bind(model, blocks, step_fn, batch, *args, **kwargs)
    bound.apply_defaults()
    with layers_always_run(model):  # LayerDrop: the step in which every block runs, the largest
        profile = measure_profile(*bound.args, **bound.kwargs)
        if bound.arguments["timing"] and calibrate_keeps:  # after the rates: fitted to the measured recompute
            budget = bound.arguments["budget"]  # within what the budget leaves beside what stays resident
            limit = None if budget is None else budget.room_for(model, batch).room_bytes
            profile = calibrated_profile(
                profile, model, blocks, step_fn, batch, fit_rates=bound.arguments["rates"] is None, limit_bytes=limit
            )
    return profile


# help() and IDEs show every argument: measure_profile's, then calibrate_keeps
_measured = list(inspect.signature(measure_profile).parameters.values())
profile_model.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [*_measured, inspect.Parameter("calibrate_keeps", inspect.Parameter.KEYWORD_ONLY, default=True, annotation="bool")],
    return_annotation="Profile",
)
