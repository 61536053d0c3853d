"""Profiling within the memory budget: how large a slice each profiling pass may take, and a stop at the budget.

A profiling pass runs the step on a slice of the batch with nothing checkpointed. It holds what lives
outside it (parameters, buffers, optimizer state, the gradients alive now, the batch: `outside_bytes`)
and what it makes: the slice, activations, new gradients, scratch (`StepCost.meta["pass_bytes"]`).
Before each pass, `SliceRoom` predicts its bytes from the passes already made on the batch, with
`MARGIN` of them held back for what is not measured yet, and the profiler shrinks or leaves out a
slice that would not fit. Every pass also runs with the tracker's limit at the room left, so a probe
(never left out on a prediction) is stopped there (`LiveBytesOverLimit`, an out-of-memory error)
instead of going over; a CUDA out-of-memory error takes the same path, and smaller probes are tried.
When even the smallest probes do not fit, no pass runs over the budget: profiling refuses the batch
(`profile_refusal`), or, when the device itself ran out, `ProfileBudgetError` stops the run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.profiling.structure.batch import tensors_in
from lightning_ckpt.profiling.memory.tracker import LiveBytesOverLimit, unique_storage_bytes
from lightning_ckpt.units import format_bytes

__all__ = [
    "AT_LIMIT", "MARGIN", "NoRoom", "checkpointed_first", "wants_checkpointed_first", "ProfileBudget", "ProfileBudgetError", "SliceRoom", "batch_bytes", "check_within",
    "optional_pass", "predicted_pass_bytes", "probe_within", "reached_bytes", "released", "SampleTooLong", "smaller_probes", "why_stopped",
]

MARGIN = 0.1  # share of a predicted pass held back for what no pass measured yet (Python objects, one op's scratch)


class ProfileBudgetError(ValueError):
    """The device ran out of memory on the smallest profile of the step."""


class SampleTooLong(Exception):
    """A pass on a batch of one sample was stopped at the room the budget leaves profiling (or the device ran
    out of memory): one sample cannot be sliced smaller along the batch, only along its tokens (the engine
    then profiles prefixes of it, `engine.length_profiles`). The state was put back. `shortfall`: what
    was measured (`profile_refusal.Shortfall`), when the room stopped it."""

    def __init__(self, reason: str, shortfall: Any = None) -> None:
        super().__init__(
            f"profiling a batch of one sample without checkpointing was stopped ({reason}); a shorter prefix of "
            "its sequence is needed to profile it within the memory budget."
        )
        self.reason, self.shortfall = reason, shortfall


@dataclass(frozen=True)
class ProfileBudget:
    """What a front end knows before profiling: the budget, and the bytes that stay resident whatever
    profiling does (parameters, buffers, optimizer state once it exists, communication buffers, a batch
    held beside the one profiled). `info` takes the lines profiling says."""

    budget_bytes: int
    resident_bytes: int
    info: Callable[[str], None] = field(default=print, compare=False)

    def room_for(self, model: nn.Module, batch: Any) -> SliceRoom:
        """The room for profiling `batch` now: the gradients `model` holds now and the batch join
        what stays resident."""
        grads = unique_storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
        return SliceRoom(self.budget_bytes, self.resident_bytes + grads + batch_bytes(batch), self.info)


def batch_bytes(batch: Any) -> int:
    """The bytes of the tensors in `batch` (each storage once)."""
    return unique_storage_bytes(tensors_in(batch))


@dataclass
class SliceRoom:
    """The passes of one profile (one batch): their room, what each measured, and predictions."""

    budget_bytes: int
    outside_bytes: int
    info: Callable[[str], None] = print
    passes: dict[int, int] = field(default_factory=dict)  # slice size -> bytes its pass held
    recompute: bool = False  # the passes run under checkpointing (`recompute_probe`): unplanned ones did not fit
    unplanned: dict[int, int] = field(default_factory=dict)  # under checkpointing: the unplanned passes that fit

    def under_checkpointing(self) -> SliceRoom:
        """The same room for passes under checkpointing (their bytes predict only each other)."""
        return dataclasses.replace(self, passes={}, recompute=True, unplanned={**self.unplanned, **self.passes})

    @property
    def room_bytes(self) -> int:
        """What a pass may hold: the budget less what lives outside it."""
        return self.budget_bytes - self.outside_bytes

    @property
    def usable_bytes(self) -> int:
        """What a pass known in advance may hold: the room, `MARGIN` held back."""
        return int(self.room_bytes / (1 + MARGIN))

    def record(self, size: int, pass_bytes: int) -> None:
        self.passes[size] = max(pass_bytes, self.passes.get(size, 0))

    def predict(self, size: int) -> int | None:
        """The bytes a pass on `size` samples will hold; None before any pass was measured.

        [line] through the two largest passes measured (bytes are linear in the slice); from one
        pass, in proportion to its size (above the line when the line has a positive intercept, as
        the parameters' gradients give it); a smaller slice holds at most what a larger one did."""
        if size in self.passes:
            return self.passes[size]
        known = sorted(self.passes.items())
        larger = [b for s, b in known if s > size]
        if larger:
            return min(larger)
        if not known:
            return None
        (s2, b2) = known[-1]
        if len(known) == 1:
            return int(math.ceil(b2 * size / s2))
        (s1, b1) = known[-2]
        slope = max(0.0, (b2 - b1) / (s2 - s1))
        return int(math.ceil(b2 + slope * (size - s2)))

    def fits(self, size: int) -> bool:
        """Whether a pass on `size` samples is predicted to fit, `MARGIN` held back (unknown: yes,
        and the tracker's limit stops it if it does not)."""
        predicted = self.predict(size)
        return predicted is None or predicted * (1 + MARGIN) <= self.room_bytes

    def need(self, size: int) -> str:
        """The predicted bytes of a pass on `size` samples with `MARGIN` held back, in words."""
        predicted = self.predict(size) or 0
        added = f"{format_bytes(predicted)} from the passes before it, {int(100 * MARGIN)} % added"
        return f"{format_bytes(predicted * (1 + MARGIN))} ({added})"

    def largest_fitting(self, above: int, at_most: int) -> int | None:
        """The largest slice in (above, at_most] predicted to fit; None when none is."""
        for size in range(at_most, above, -1):
            if self.fits(size):
                return size
        return None

    @property
    def limit_bytes(self) -> int:
        """The tracker's limit for a probe: the room."""
        return self.room_bytes

    def _resident(self) -> str:
        return (
            f"{format_bytes(self.outside_bytes)} that stays resident (parameters, buffers, optimizer state, "
            "gradients, the batch)"
        )

    def refusal(self, size: int, stopped: str) -> ProfileBudgetError:
        """The error when the device itself ran out of memory (`stopped` says how) on the smallest probe,
        `size` samples."""
        return ProfileBudgetError(
            f"profiling the step on a slice of {size} sample(s) without checkpointing ran {stopped}, beside the "
            f"{self._resident()}: the device holds less than memory_budget={format_bytes(self.budget_bytes)} says. "
            "Free device memory or lower memory_budget to what the device holds, or make each sample smaller (a "
            "shorter maximum sequence length, smaller images)."
        )


_CHECKPOINTED_FIRST: contextvars.ContextVar[bool] = contextvars.ContextVar("checkpointed_first", default=False)


@contextlib.contextmanager
def checkpointed_first() -> Iterator[None]:
    """Profiles made inside start under checkpointing (`recompute_probe`), with no unplanned pass first: for a
    caller that already knows the unplanned pass does not fit (a stopped pass overshoots by the op that
    stopped it)."""
    token = _CHECKPOINTED_FIRST.set(True)
    try:
        yield
    finally:
        _CHECKPOINTED_FIRST.reset(token)


def wants_checkpointed_first() -> bool:
    return _CHECKPOINTED_FIRST.get()


class NoRoom(Exception):
    """A probe that was stopped (`reason` says why: `AT_LIMIT`, or the device's out-of-memory error);
    `reached_bytes`: what the pass held (the slice included) when the tracker's limit stopped it."""

    def __init__(self, size: int, reason: str, reached_bytes: int | None = None) -> None:
        super().__init__(size, reason)
        self.size, self.reason, self.reached_bytes = size, reason, reached_bytes


Pass = Callable[[int | None], StepCost]  # a profiling pass, given the most it may hold (None: no limit)


def probe_within(room: SliceRoom | None, size: int, run: Pass) -> StepCost:
    """A probe on `size` samples (`run`); with `room`, within its limit, else `NoRoom` (the state put back).
    A probe is never left out on a prediction: the tracker's limit says whether it fits."""
    if room is None:
        return run(None)
    reason = reached = None
    try:
        with _quiet_when_stopped():
            cost = run(room.limit_bytes)
    except torch.OutOfMemoryError as err:  # its frames hold the pass's tensors: raised on without them
        reason, reached = why_stopped(err), reached_bytes(err, room.limit_bytes)
    if reason is not None:
        raise NoRoom(size, reason, reached)
    room.record(size, cost.meta["pass_bytes"])
    return cost


def check_within(room: SliceRoom | None, above: int, size: int) -> int | None:
    """The check slice: `size`, or with `room` the largest above `above` predicted to fit (None: none),
    with a line that says so when it is not `size`."""
    if room is None:
        return size
    fitting = room.largest_fitting(above, size)
    if fitting != size and room.fits(above):  # (when the probes themselves do not fit, profiling refuses the batch)
        instead = f"a check slice of {fitting} samples" if fitting else "no check slice (the fitted line is not checked)"
        room.info(
            f"lightning-ckpt: profiling with {instead}: unplanned, {size} samples are predicted to need "
            f"{room.need(size)}, more than the {format_bytes(max(0, room.room_bytes))} the memory budget leaves profiling."
        )
    return fitting


def reached_bytes(err: BaseException, room_bytes: int) -> int | None:
    """What a pass stopped by the tracker's limit held, the slice included: the tracker's limit is the room
    less what stays outside it (the slice; in a block run again, what the pass held when it began)."""
    reached, limit = getattr(err, "reached_bytes", None), getattr(err, "limit_bytes", None)
    return None if reached is None or limit is None else reached + room_bytes - limit


def predicted_pass_bytes(passes: dict[int, int], length: int) -> int | None:
    """The bytes a pass at `length` will hold, from the passes measured at shorter prefixes: the
    polynomial of degree at most 2 through them, or from one pass in proportion to the square of the
    length (attention's scores); None before any pass."""
    if not passes:
        return None
    xs = sorted(passes)
    longer = [passes[x] for x in xs if x >= length]
    if longer:  # a shorter prefix holds at most what a longer one did
        return min(longer)
    if len(xs) == 1:
        return int(math.ceil(passes[xs[0]] * (length / xs[0]) ** 2))
    coef = np.polynomial.polynomial.polyfit(xs, [passes[x] for x in xs], min(2, len(xs) - 1))
    return int(math.ceil(max(float(np.polynomial.polynomial.polyval(length, coef)), passes[xs[-1]])))


def optional_pass(room: SliceRoom | None, size: int | None, what: str, run: Pass) -> StepCost | None:
    """A check slice of `size` samples (None: none); one that runs out of memory, or of `room`, is left
    out, its state put back, with a warning."""
    if size is None:
        return None
    reason = None
    try:
        with _quiet_when_stopped():
            cost = run(None if room is None else room.room_bytes)
    except torch.OutOfMemoryError as err:  # its frames hold the pass's tensors: let go of them before going on
        reason = why_stopped(err)
    if reason is not None:
        released()
        warnings.warn(f"lightning-ckpt: the {what} of {size} samples was stopped ({reason}); the profile goes on "
                      "without it.", stacklevel=3)
        return None
    if room is not None:
        room.record(size, cost.meta["pass_bytes"])
    return cost


@contextlib.contextmanager
def _quiet_when_stopped() -> Iterator[None]:
    """The warning torch gives for the profiler's own hooks that fail while a stopped pass unwinds ("module
    forward hook with ``always_call=True`` raised an exception that was silenced") left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="module forward hook with ``always_call=True`` raised an exception")
        yield


AT_LIMIT = "it reached the room the memory budget leaves profiling"  # why a pass the tracker stopped was stopped


def why_stopped(err: BaseException | None) -> str:
    """A pass's out-of-memory error, in a few words (`AT_LIMIT` for the tracker's)."""
    if isinstance(err, LiveBytesOverLimit) or err is None:
        return AT_LIMIT
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"out of memory: {first[:160]}"


def released() -> None:
    """Free what a stopped pass left for the garbage collector, and on CUDA hand its cached blocks back."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def smaller_probes(sizes: Sequence[int], least: int) -> tuple[int, int] | None:
    """The probe sizes halved (at least `least` and two apart by one); None when they cannot shrink."""
    a = max(least, sizes[0] // 2)
    b = max(a + 1, sizes[1] // 2)
    return (a, b) if (a, b) != tuple(sizes) and b < sizes[1] else None
