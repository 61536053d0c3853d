"""A batch of one sequence costed along its tokens: the fit in the length, past the longest profiled one.

A batch of one sample cannot be sliced along the batch, so it is profiled whole when that fits the
budget and on prefixes of its sequence (`profiling.structure.shapes.slice_length`) that do. Bytes and work
are polynomials of degree at most 2 in the length (`planning.shape_profile`); a length past the
longest profiled one is costed from that polynomial when its leave-one-out check holds, with the
checked miss, grown with the square of how far the length goes past, held in reserve.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.policies import InfeasibleBudgetError
from lightning_ckpt.planning.shape_profile import FIT_TOLERANCE, MIN_FIT_LENGTHS, ShapeProfile, checked_bytes
from lightning_ckpt.profiling.passes.profile_budget import MARGIN, SampleTooLong, checkpointed_first, predicted_pass_bytes
from lightning_ckpt.profiling.passes.profile_refusal import ProfileRefused, Shortfall, longest_prefix
from lightning_ckpt.profiling.structure.shapes import BatchShape
from lightning_ckpt.units import format_bytes

FIRST_FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # prefixes profiled first, shortest first: with the whole, a checked quadratic
MORE_FRACTIONS = (0.375, 0.625, 0.875)  # and, when the whole does not fit, all of them that do
EXTRAPOLATE = 2.0  # at batch 1 the fit may cost a length up to this many times the longest profiled one
# at larger batches, which can be profiled whole: a little past the longest profiled length (new longest lengths
# of a run that keeps growing), the reserve then at most 1.56x the checked miss
GROW = 1.25
RoomFn = Callable[[], "int | None"]  # the bytes a profiling pass may hold (None: not known)


def profile_lengths(
    length: int, known: set, profile_at: Callable[[int], Profile], room_fn: RoomFn | None,
) -> tuple[int, ...]:
    """Profile a sequence of `length` tokens at prefixes (`profile_at`), shortest first, and whole last;
    a length predicted not to fit the room (`MARGIN` held back) is not run, and the first that is stopped
    at it (`SampleTooLong`) ends the longer ones. When the whole does not fit, more prefixes between
    those that did are profiled, so that the fit past them is checked on enough lengths, and the whole is
    tried once more: a pass that does not fit unplanned is made under checkpointing, about what the `full`
    plan holds (`profiling.passes.measured_profile`). -> the lengths profiled."""
    passes: dict[int, int] = {}
    done: list[int] = []

    def run(fractions: Sequence[float]) -> None:
        for f in fractions:
            x = max(1, int(round(length * f)))
            if x in known or x in done:
                continue
            predicted, room = predicted_pass_bytes(passes, x), None if room_fn is None else room_fn()
            if predicted is not None and room is not None and predicted * (1 + MARGIN) > room:
                return
            try:
                profile = profile_at(x)
            except SampleTooLong:
                return
            passes[x] = int(profile.probes[0].meta.get("pass_bytes", 0))
            done.append(x)

    run(FIRST_FRACTIONS)
    if length not in done:  # shortest first again, with those between: predicted from more passes now
        run(sorted((*FIRST_FRACTIONS[:-1], *MORE_FRACTIONS)))
    if length not in done and length not in known:  # the whole once more: under checkpointing it may fit
        try:
            with checkpointed_first():  # (unplanned it was predicted not to fit, or stopped)
                profile_at(length)
            done.append(length)
        except SampleTooLong:
            pass
    return tuple(sorted(done))


def extrapolated(
    fitted: ShapeProfile | None, length: int, batch_size: int = 1, factor: float = EXTRAPOLATE,
) -> tuple[Callable[..., StepCost], str] | None:
    """How to cost `batch_size` at `length`, longer than every profiled length, from `fitted`, and in
    words; None when the fit is not checked within `FIT_TOLERANCE` or `length` is more than `factor`
    times the longest profiled one."""
    if fitted is None or not fitted.lengths[-1] < length <= factor * fitted.lengths[-1]:
        return None
    err = fitted.fit_error(batch_size)
    if err is None or err > FIT_TOLERANCE:
        return None
    # [reserve] the checked miss (at least the tolerance) and the transients' (bytes), grown with the square of the
    # distance past the data
    growth = (length / fitted.lengths[-1]) ** 2
    share = max(err, FIT_TOLERANCE) * growth
    transient = int(math.ceil((fitted.transient_miss_bytes(batch_size) or 0) * growth))

    def cost_of(batch_size: int, **step_fields) -> StepCost:
        cost = fitted.at(batch_size, length, **step_fields)
        reserve = int(math.ceil(share * sum(checked_bytes(cost)))) + transient
        return dataclasses.replace(cost, pre_saved_bytes=cost.pre_saved_bytes + reserve)

    lengths = ", ".join(map(str, fitted.lengths))
    source = (
        f"extrapolated from lengths {lengths} at batch {batch_size} (checked within {100 * err:.2f} %, "
        f"{100 * share:.2f} % and {format_bytes(transient)} for the transients held in reserve)"
    )
    return cost_of, source


def longest_length(family: Any, shape: BatchShape, fits: Callable[[Callable[..., StepCost], BatchShape], bool]) -> int | None:
    """The longest length of the varying dimension of `family` (`engine.shape_plans.ShapeFamily`) at `shape`'s
    batch size whose step `fits`, costed from the profiles alone (profiled, fitted, or extrapolated up to
    `EXTRAPOLATE` times the longest profiled length); None when not even the shortest profiled one fits."""
    fitted = family.shape_profile()
    if fitted is None:
        return None
    positions = family.positions()

    def at(x: int) -> BatchShape:
        sizes = tuple(tuple(x if (i, d) in positions else n for d, n in enumerate(s)) for i, s in enumerate(shape.shapes))
        return BatchShape(shape.batch_size, sizes)

    def ok(x: int) -> bool:
        found = family.cost_of(at(x))
        return found is not None and fits(found[0], at(x))

    lo, hi = fitted.lengths[0], int(EXTRAPOLATE * fitted.lengths[-1])
    if not ok(lo):
        return None
    while lo < hi:  # [invariant] lo fits; a step's memory grows with the length, so halving finds the longest
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def longest_by_prefixes(
    length: int, done: Sequence[int], profile_at: Callable[[int], Profile],
) -> tuple[int, int, tuple[int, ...]]:
    """When the sequence of `length` tokens could not be costed: the longest prefix that is profiled within the
    budget, under checkpointing, between the longest of `done` and `length` (bounded passes, bisecting:
    `profiling.passes.profile_refusal.longest_prefix`); each profile made is kept by `profile_at` (with enough of
    them, the fit may cost the whole after all). -> (the longest that fit, 0 when none did; the shortest
    tried; the lengths profiled)."""
    lo = max((x for x in done if x < length), default=0)

    def pass_at(x: int) -> int | None:
        try:
            with checkpointed_first():
                return int(profile_at(x).probes[0].meta.get("pass_bytes", 0))
        except SampleTooLong:
            return None

    longest, shortest, held = longest_prefix(length, pass_at, lo=lo)
    return longest, shortest, tuple(sorted(held))


def too_long(
    shape: BatchShape, length: int | None, profiled: Sequence[int], why_not: str | None,
    shortfall: Shortfall | None = None, longest: tuple[int, int, tuple[int, ...]] | None = None,
    passes: dict[int, int] | None = None, planned: bool = False,
) -> InfeasibleBudgetError:
    """The error for a batch of one sample that could not be costed: too long to profile whole within
    the budget, with too few prefixes that fit (or none could be cut). With `shortfall` (what the pass on the
    whole sample measured when it was stopped), the numbers: the `full` plan's peak at least, about as
    extrapolated from `passes` ({length: bytes} of prefixes profiled under checkpointing), and `longest`
    (`longest_by_prefixes`); `planned`: its prefixes did cost it in the end, and no plan fits."""
    got = f"only the prefixes of length(s) {', '.join(map(str, profiled))} fit" if profiled else "no prefix of it fit"
    need = f"at least {MIN_FIT_LENGTHS} prefixes up to 1/{EXTRAPOLATE:g} of its length"
    extra = f" (prefixes could not be cut: {why_not})" if why_not else ""
    fit = f"{got}{extra}; costing it from its prefixes needs {need} to fit, so that a quadratic in the length can be fitted and checked"
    if shortfall is None:
        return InfeasibleBudgetError(
            f"the training batch of one sample ({shape.describe()}, length {length}) does not fit the room the memory "
            f"budget leaves profiling without checkpointing, and {fit}. Raise memory_budget or train on shorter sequences."
        )
    estimate = None if not passes or length is None else predicted_pass_bytes(passes, length)
    found = dataclasses.replace(
        shortfall, batch=f"{shape.describe()}, length {length}", length_tokens=length,
        longest_tokens=None if longest is None else longest[0], shortest_tokens=None if longest is None else longest[1],
        estimate_bytes=None if estimate is None else shortfall.outside_bytes + estimate,
        estimate_from=f"extrapolated from the passes on prefixes of {', '.join(map(str, sorted(passes or ())))} tokens "
                      "under checkpointing", nested_planned=planned,
    )
    if planned:
        return ProfileRefused(found)
    return ProfileRefused(found, f"{found.message()} Of its prefixes {fit}.")
