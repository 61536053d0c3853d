"""A profile of the step: `probe_step` at two small slices of the batch and a check on a third, each within the
memory budget (`profile_budget`), with the machine's rates measured once (`rates`) so that counted work can be
turned into time. When even the smallest slices do not fit the room unplanned, they are profiled under
checkpointing (`recompute_probe`), which holds about what the `full` plan holds and measures the same; when
even those do not fit, the batch is refused (`profile_refusal`) before any pass goes over the budget.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile, refit_without_smallest
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.profiling.forward_state.applied_marks import refuse_marked
from lightning_ckpt.profiling.structure.batch import batch_size_of, slice_batch
from lightning_ckpt.profiling.passes.forward_passes import time_blocks as _time_blocks
from lightning_ckpt.profiling.work.gather import sharded_world_size
from lightning_ckpt.profiling.passes.profile_budget import NoRoom, ProfileBudget, SliceRoom, batch_bytes, check_within, optional_pass
from lightning_ckpt.profiling.passes.profile_budget import probe_within
from lightning_ckpt.profiling.passes.profile_budget import AT_LIMIT, SampleTooLong, predicted_pass_bytes, released, smaller_probes
from lightning_ckpt.profiling.passes.profile_budget import wants_checkpointed_first
from lightning_ckpt.profiling.passes.profile_refusal import ProfileRefused, Shortfall, longest_prefix
from lightning_ckpt.profiling.passes.profiler import StepFn, probe_step
from lightning_ckpt.profiling.passes.recompute_probe import RecomputeMismatch
from lightning_ckpt.profiling.structure.shapes import length_of, sequence_positions, shape_of, slice_length
from lightning_ckpt.profiling.forward_state.state import preserved_state
from lightning_ckpt.profiling.memory.tracker import unique_storage_bytes
from lightning_ckpt.units import format_bytes

__all__ = ["BATCHNORM_ONE_SAMPLE", "measure_profile"]

MAX_REFITS = 2  # how often profiling leaves its smallest slice out and checks on one twice as large
_START = (1, 2)  # the probes under checkpointing, when the unplanned ones could not be made small enough


def measure_profile(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: StepFn,
    batch: Any,
    probe_batch_sizes: tuple[int, int] = (1, 2),
    check_batch_size: int | None = 4,
    names: Sequence[str] | None = None,
    timing: bool = True,
    rates: MachineRates | None = None,
    time_blocks: bool = True,
    budget: ProfileBudget | None = None,
) -> Profile:
    """Probe at two small slices of `batch` (and check on a third) -> `Profile`.

    With `budget`, every pass fits it (`profile_budget`): a check or refit slice predicted not to
    fit is shrunk to the largest that is, or left out (one line says so); a pass that reaches the
    room left to it, or runs out of CUDA memory, is stopped, the state put back, and the profile goes
    on without it (smaller probes when it was a probe, with a warning). When even the smallest probes
    do not fit under checkpointing, `ProfileRefused` (an `InfeasibleBudgetError`) says so with what was
    measured, before any pass goes over the budget; a device out of memory there is a `ProfileBudgetError`.

    When the line through the two probes misses the check slice, the smallest probe is left out
    (`linear_fit.refit_without_smallest`): the probe and the check define the line, and a slice of
    twice the check size checks it when the batch is that large (`Profile.fit_note` says so).
    Blocks sharded over several ranks (ZeRO-3, FSDP2) get no such larger slice: every rank runs
    the same passes, whatever its own bytes say.

    With `timing`, blocks are timed (unless `time_blocks` is False: only the `ms` cost metric and
    the plan table's measured forward time read them; 0.2 s of a profile on the encoder example)
    and the machine's rates measured on the device
    and dtypes that did most of the probed work (`rates.measure_rates`, 0.3-1.3 s on one CPU thread,
    kept for later runs: `rates.kept_rates`);
    `rates` given are used as they are. Either way they land in `meta["rates"]` of
    every probe, which the `time` cost metric needs. What keeping op outputs saves is measured
    later, by applying (`engine.step_profile.profile_model` calls `apply.keep_calibration`).
    """
    refuse_marked(blocks, names, "profile the blocks")  # they would measure the plan, not themselves
    n = batch_size_of(batch)
    sizes = [s for s in (*probe_batch_sizes, check_batch_size) if s is not None]
    if any(s < 1 for s in sizes) or len(set(probe_batch_sizes)) != 2:
        raise ValueError(f"probe batch sizes must be two different positive integers, got {probe_batch_sizes}.")
    fixed = sharded_world_size(blocks) > 1
    room = None if budget is None or fixed else budget.room_for(model, batch)
    if room is not None and room.room_bytes <= 0:  # what stays resident is over the budget alone: no pass can fit
        raise ProfileRefused(Shortfall(room.budget_bytes, room.outside_bytes, shape_of(batch).describe(), n))
    if n == 1:  # one sample: one pass on the whole batch; lengths are the engine's (`engine.length_profiles`)
        return _one_sample_profile(model, blocks, step_fn, batch, names, timing and time_blocks, timing, rates, room)
    if max(sizes) > n:
        raise ValueError(
            f"the batch has {n} samples but profiling slices up to {max(sizes)}; pass a larger batch or "
            "smaller probe_batch_sizes / check_batch_size."
        )
    # Sharded blocks gather their parameters in every forward: ranks profiling together must run the
    # same passes, and their bytes may differ a little (uneven shards, buffers the communication
    # thread frees when it gets to it), so no pass here may depend on them: the check is timed with
    # the probes and no larger check is added.
    timed = timing and time_blocks
    # sharded blocks: no rank's bytes may decide which passes run (see above), so no budget decides them
    probes, probe_batch_sizes, check_batch_size, room = _first_probes(
        model, blocks, step_fn, batch, tuple(probe_batch_sizes), check_batch_size, names, timed, room
    )
    under = room is not None and room.recompute  # (the check slices then too)
    check = None
    if check_batch_size is not None and check_batch_size not in probe_batch_sizes:
        size = check_within(room, max(probe_batch_sizes), check_batch_size)
        check = optional_pass(
            room, size, "check slice", _pass(model, blocks, step_fn, batch, size, names, timed and fixed, under)
        )
    fitted = refit_without_smallest(Profile(probes=probes, check=check))  # type: ignore[arg-type]
    size = None if check is None else check.batch_size
    for _ in range(0 if fixed else MAX_REFITS):
        if fitted.probes[0] is probes[0] or fitted.check is not None:
            break
        # [constraint] the smallest slice is off the line: the two larger ones define it, and a slice
        # twice the check, when the batch has one, checks it again (`Profile.fit_note` says so); with a
        # budget, the largest slice up to that which fits it
        probes, check = fitted.probes, None
        if 2 * size > n:
            break
        size = 2 * size if room is None else room.largest_fitting(size, 2 * size)
        check = optional_pass(
            room, size, "refit check slice", _pass(model, blocks, step_fn, batch, size, names, False, under)
        )
        if check is None:
            break
        fitted = refit_without_smallest(Profile(probes=probes, check=check))  # type: ignore[arg-type]
    probes, check = fitted.probes, fitted.check
    if timed and not fixed:  # check slices promoted by the refit were profiled untimed: timed now
        probes = tuple(p if p.batch_size in probe_batch_sizes else _timed(model, blocks, step_fn, batch, p) for p in probes)
    if rates is None and timing:
        from lightning_ckpt.profiling.machine.rates import kept_rates

        rates = kept_rates(**probes[-1].meta["work"], max_bytes=None if room is None else room.usable_bytes)
    if rates is not None:
        probes = tuple(_with_rates(p, rates) for p in probes)
        check = None if check is None else _with_rates(check, rates)
    return Profile(probes=probes, check=check)  # type: ignore[arg-type]



# torch's words when a BatchNorm in training gets one value per channel: (1, C) features, (1, C, 1, 1) maps
BATCHNORM_ONE_SAMPLE = "Expected more than 1 value per channel when training"


def _first_probes(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, sizes: tuple[int, int],
    check: int | None, names: Sequence[str] | None, timed: bool, room: SliceRoom | None = None, least: int = 1,
) -> tuple[tuple[StepCost, StepCost], tuple[int, int], int | None, SliceRoom | None]:
    """The probes at `sizes` -> (probes, sizes, check, the room they ran in). When the smallest is one sample and a BatchNorm
    refuses it (pooled (batch, channels) features have one value per channel), the sizes and the check
    are doubled, (1, 2) and 4 becoming (2, 4) and 8, with a warning that says so; a batch too small
    for that is refused with the sizes to set. With `room`, a probe stopped at its limit or out of CUDA
    memory gives way to probes half as large (at least `least`), with a warning; when they cannot be
    smaller, the probes start again under checkpointing (`recompute_probe`: the same measurements, about
    what the `full` plan holds), with a line that says so; when even those cannot be smaller, or cannot be
    made under checkpointing, the batch is refused (`ProfileRefused`; out of device memory there:
    `ProfileBudgetError`)."""
    under = room is not None and room.recompute
    try:
        probes = tuple(probe_within(room, s, _pass(model, blocks, step_fn, batch, s, names, timed, under)) for s in sizes)
    except NoRoom as short:
        released()
        assert room is not None
        smaller = smaller_probes(sizes, least)
        if smaller is None and short.reason != AT_LIMIT:  # the device itself is out of memory
            raise room.refusal(short.size, short.reason) from None
        if smaller is None and not under:  # nothing smaller fits unplanned: under checkpointing
            room.info(
                f"lightning-ckpt: unplanned, {short.size} sample(s) do not fit the {format_bytes(max(0, room.room_bytes))} "
                "the memory budget leaves profiling; the step is profiled under checkpointing instead (each block's "
                "saved tensors rebuilt in its backward: the same measurements, about what the `full` plan holds)."
            )
            try:
                return _first_probes(
                    model, blocks, step_fn, batch, _START, check, names, timed, room.under_checkpointing(), least
                )
            except RecomputeMismatch as err:
                released()
                raise _refused(model, blocks, step_fn, batch, names, room, short, f"not under checkpointing: {err}") from None
        if smaller is None:  # not even the smallest probes fit under checkpointing: refused, nothing over the budget
            raise _refused(model, blocks, step_fn, batch, names, room, short) from None
        warnings.warn(
            f"lightning-ckpt: profiling on {short.size} samples was stopped ({short.reason}); the step is profiled "
            f"at probe_batch_sizes={smaller} instead of {sizes}.",
            stacklevel=3,
        )
        return _first_probes(model, blocks, step_fn, batch, smaller, check, names, timed, room, least)
    except RecomputeMismatch:
        raise
    except ValueError as err:
        if 1 not in sizes or BATCHNORM_ONE_SAMPLE not in str(err):
            raise
        n, shifted = batch_size_of(batch), (2, 2 * max(sizes))
        if shifted[1] > n:
            fix = f"probe_batch_sizes=(2, {n})" if n > 2 else "a batch of at least 3 samples and probe_batch_sizes=(2, 3)"
            raise ValueError(
                f"the probe of 1 sample failed in a BatchNorm ({err}): in training a BatchNorm over (batch, channels) "
                f"features needs at least 2 samples, and the batch has {n}, too few for probes {shifted}. "
                f"Set {fix}."
            ) from err
        check = None if check is None or 2 * check > n else 2 * check
        warnings.warn(
            f"lightning-ckpt: a BatchNorm refuses a slice of 1 sample in training ({BATCHNORM_ONE_SAMPLE}), so "
            f"the step is profiled at probe_batch_sizes={shifted} instead of {sizes} and check_batch_size={check}; "
            f"set probe_batch_sizes={shifted} to start there.",
            stacklevel=3,
        )
        return _first_probes(model, blocks, step_fn, batch, shifted, check, names, timed, room, least=2)
    return probes, sizes, check, room  # type: ignore[return-value]


def _one_sample_profile(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, names: Sequence[str] | None,
    timed: bool, timing: bool, rates: MachineRates | None, room: SliceRoom | None,
) -> Profile:
    """The profile of a batch of one sample: one pass on it, within `room` (else `SampleTooLong`, the state
    put back), as a profile at batch size 1 only (`Profile.one_size`)."""
    probe = unplanned = None
    if room is None or not wants_checkpointed_first():
        try:
            probe = probe_within(room, 1, _pass(model, blocks, step_fn, batch, 1, names, timed))
        except NoRoom as short:
            released()
            if short.reason != AT_LIMIT or room is None:
                raise SampleTooLong(short.reason) from None
            unplanned = short
    if probe is None:  # unplanned it does not fit: under checkpointing, the whole sample at once
        room = room.under_checkpointing()
        try:
            probe = probe_within(room, 1, _pass(model, blocks, step_fn, batch, 1, names, timed, True))
        except (NoRoom, RecomputeMismatch) as short:
            released()
            stopped = short if isinstance(short, NoRoom) else unplanned
            why = "" if isinstance(short, NoRoom) else f"not under checkpointing: {short}"
            shortfall = None if stopped is None else Shortfall(
                room.budget_bytes, room.outside_bytes, shape_of(batch).describe(), 1, 1, stopped.reached_bytes,
                recompute=not why, why=why,
            )
            raise SampleTooLong(short.reason if isinstance(short, NoRoom) else f"{AT_LIMIT}; {short}", shortfall) from None
        room.info(
            "lightning-ckpt: the batch's one sample does not fit the room the memory budget leaves profiling "
            "unplanned; it was profiled under checkpointing (each block's saved tensors rebuilt in its backward: "
            "the same measurements, about what the `full` plan holds)."
        )
    if rates is None and timing:
        from lightning_ckpt.profiling.machine.rates import kept_rates

        rates = kept_rates(**probe.meta["work"], max_bytes=None if room is None else room.usable_bytes)
    if rates is not None:
        probe = _with_rates(probe, rates)
    return Profile(probes=(probe, probe), check=None)


def _refused(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, names: Sequence[str] | None,
    room: SliceRoom, short: NoRoom, why: str = "",
) -> ProfileRefused:
    """The refusal of `batch` after the probe `short` was stopped (under checkpointing when `room.recompute`;
    unplanned, for `why`, when not): the passes that fit say the largest batch and an estimate at the batch's
    size; when not even one sample fits under checkpointing, bounded passes on prefixes of one sample say the
    longest sequence that fits (`longest_prefix`)."""
    n = batch_size_of(batch)
    fitted = {**room.unplanned, **room.passes} if room.recompute else dict(room.passes)
    estimate = high = from_what = None
    if room.passes and n > max(room.passes):
        estimate, high = _scaled(model, room, n)
        from_what = f"from the pass(es) on {', '.join(map(str, sorted(room.passes)))} sample(s) that fit"
    longest = shortest = length = None
    if room.recompute and not fitted:
        found = _longest_prefix(model, blocks, step_fn, batch, names, room)
        if found is not None:
            length, longest, shortest, held = found
            if held:
                estimate = room.outside_bytes + predicted_pass_bytes(held, length)
                from_what = (f"at batch 1, extrapolated from the passes on prefixes of {', '.join(map(str, sorted(held)))} "
                             "tokens under checkpointing")
    return ProfileRefused(Shortfall(
        room.budget_bytes, room.outside_bytes, shape_of(batch).describe(), n, short.size, short.reached_bytes,
        recompute=room.recompute, fitted=tuple(sorted(fitted.items())), why=why, length_tokens=length,
        longest_tokens=longest, shortest_tokens=shortest, estimate_bytes=estimate, estimate_high_bytes=high,
        estimate_from=from_what or "",
    ))


def _scaled(model: nn.Module, room: SliceRoom, n: int) -> tuple[int, int | None]:
    """The step's peak at `n` samples from the passes that fit: on the line through two; from one, a range
    (the gradients the pass makes held fixed, below; all of it in proportion to the slice, above)."""
    if len(room.passes) >= 2:
        return room.outside_bytes + room.predict(n), None
    [(size, held)] = room.passes.items()
    grads = unique_storage_bytes(p for p in model.parameters() if p.requires_grad and p.grad is None)
    fixed = min(grads, held)
    low = fixed + (held - fixed) * n // size
    return room.outside_bytes + low, room.outside_bytes + held * n // size


def _longest_prefix(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, names: Sequence[str] | None,
    room: SliceRoom,
) -> tuple[int, int, int, dict[int, int]] | None:
    """For a batch of sequences: (its length, the longest prefix of one sample that fits `room` under
    checkpointing, the shortest tried, {length: bytes} of those that fit); None for a batch with no token
    dimension, or one whose prefixes the model rejects."""
    one = slice_batch(batch, 1)
    positions = sequence_positions(shape_of(one))
    length = length_of(shape_of(one), positions) if positions else None
    if length is None or length < 2:
        return None

    # the sample cut from the batch is held beside each prefix: the prefixes' room is less by its bytes
    within = dataclasses.replace(room, outside_bytes=room.outside_bytes + batch_bytes(one), passes={}, recompute=True)

    def pass_at(x: int) -> int | None:
        part = slice_length(one, positions, x)
        try:
            cost = probe_within(within, 1, lambda room_bytes: probe_step(model, blocks, step_fn, part, names, False, room_bytes, True))
        except (NoRoom, RecomputeMismatch):
            released()
            return None
        return int(cost.meta["pass_bytes"])

    try:
        longest, shortest, held = longest_prefix(length, pass_at)
    except Exception:  # noqa: BLE001 - a prefix the model rejects: no length is said
        released()
        return None
    return length, longest, shortest, held


def _pass(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, size: int | None,
    names: Sequence[str] | None, timing: bool, recompute: bool = False,
) -> Callable[[int | None], StepCost]:
    """`probe_step` on the first `size` samples of `batch`, given the room it may hold (`profile_budget`)."""
    return lambda room_bytes: probe_step(
        model, blocks, step_fn, slice_batch(batch, size), names, timing, room_bytes, recompute
    )


def _timed(model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, probe: StepCost) -> StepCost:
    """`probe` (profiled untimed, as a check slice is) with its blocks' forward times measured."""
    with preserved_state(model):
        fwd_ms = _time_blocks(model, blocks, step_fn, slice_batch(batch, probe.batch_size))
    return dataclasses.replace(probe, blocks=tuple(dataclasses.replace(b, fwd_ms=t) for b, t in zip(probe.blocks, fwd_ms)))


def _with_rates(cost: StepCost, rates: MachineRates) -> StepCost:
    return dataclasses.replace(cost, meta={**cost.meta, "rates": rates.to_dict()})
