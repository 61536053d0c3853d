"""Refusing a batch that profiling cannot measure within the memory budget, before any pass goes over it.

When even the smallest pass is stopped at the room the budget leaves profiling, under checkpointing too
(which holds about what the `full` plan holds), no plan of that kind fits: `Shortfall` is what was
measured on the way, and `ProfileRefused` (an `InfeasibleBudgetError`) says it with the numbers: the budget
and the batch received, the `full` plan's peak (at least what the stopped pass reached, and an estimate
from the passes that fit), the largest batch and the longest sequence that fit, and what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_ckpt.costs.budget_error import InfeasibleBudgetError
from lightning_ckpt.units import format_bytes

__all__ = ["SEARCH_PASSES", "ProfileRefused", "Shortfall", "longest_prefix"]

SEARCH_PASSES = 6  # bounded passes on prefixes that look for the longest sequence that fits (halving, then bisecting)

_RESIDENT = "parameters, buffers, optimizer state, gradients, the batch"
_UNDER = "under checkpointing (every block's saved tensors rebuilt in its backward: about what the `full` plan holds)"


@dataclass(frozen=True)
class Shortfall:
    """What profiling measured when its smallest pass did not fit. `reached_bytes`: what the stopped pass held,
    the slice included (None: no pass ran, what stays resident is over the budget alone); `fitted`: (samples,
    bytes) of the passes of the same kind that fit; `why`: why the passes were not made under checkpointing;
    `longest_tokens`: at batch 1, the longest prefix that fit under checkpointing (0: none of those tried,
    the shortest being `shortest_tokens`; None: not looked for); `estimate_bytes`: the step's peak at the
    batch, estimated as `estimate_from` says."""

    budget_bytes: int
    outside_bytes: int
    batch: str
    batch_size: int
    stopped_size: int = 1
    reached_bytes: int | None = None
    recompute: bool = True
    fitted: tuple[tuple[int, int], ...] = ()
    why: str = ""
    length_tokens: int | None = None
    longest_tokens: int | None = None
    shortest_tokens: int | None = None
    estimate_bytes: int | None = None
    estimate_high_bytes: int | None = None  # with `estimate_bytes`, a range
    estimate_from: str = ""
    pass_words: str = ""  # what the stopped pass was, when not a profiling pass
    nested_planned: bool = False  # costed from prefixes of the sequence all the same: no plan fits, nested ones included

    @property
    def room_bytes(self) -> int:
        return self.budget_bytes - self.outside_bytes

    @property
    def at_least_bytes(self) -> int | None:
        """The step's peak at the batch is at least this: what stays resident and what the stopped pass reached
        (a larger slice holds at least what a smaller one does)."""
        return None if self.reached_bytes is None else self.outside_bytes + self.reached_bytes

    @property
    def largest_batch(self) -> int:
        return max((s for s, _ in self.fitted), default=0)

    def message(self) -> str:
        head = (
            f"lightning-ckpt: the training batch of shape ({self.batch}) was refused before profiling went over "
            f"memory_budget={format_bytes(self.budget_bytes)}"
        )
        if self.reached_bytes is None:  # (the words planning uses for a state over the budget)
            return (
                f"{head}: not even batch size 1 fits: the model's state takes {format_bytes(self.outside_bytes)} of the "
                f"{format_bytes(self.budget_bytes)} budget ({_RESIDENT}), {format_bytes(-self.room_bytes)} over it "
                "before any activation. Lower target_batch_size or raise memory_budget."
            )
        how = self.pass_words or (_UNDER if self.recompute else f"unplanned ({self.why})")
        whose = "the `full` plan's" if self.recompute else "the unplanned step's"
        peak = f"{whose} peak at batch {self.batch_size} is at least {format_bytes(self.at_least_bytes)}"
        if self.estimate_bytes is not None:
            high = "" if self.estimate_high_bytes is None else f" to {format_bytes(self.estimate_high_bytes)}"
            peak += f", about {format_bytes(self.estimate_bytes)}{high} {self.estimate_from}"
        parts = [
            (f"{head}: beside the {format_bytes(self.outside_bytes)} that stays resident ({_RESIDENT}) it leaves "
             f"{format_bytes(max(0, self.room_bytes))} to profiling, and a pass on {self.stopped_size} sample(s) {how} "
             f"needs more: it was stopped there at {format_bytes(self.reached_bytes)}, so {peak}."),
            f"The largest batch that fits is {self.largest_batch}." if self.largest_batch
            else "No batch fits at this size, not even 1 sample.",
        ]
        if self.longest_tokens:
            parts.append(
                f"At batch 1 the longest sequence that fits is {self.longest_tokens} tokens of {self.length_tokens} "
                f"(prefixes profiled under checkpointing within the budget, in at most {SEARCH_PASSES} passes)."
            )
        elif self.longest_tokens == 0:
            parts.append(f"No sample fits: not even a prefix of {self.shortest_tokens} token(s) under checkpointing.")
        if self.nested_planned:
            parts.append(
                "Costed from its prefixes all the same (the fit through them, extrapolated to its length), no plan "
                "fits either, multi-level ones (policy='optimal' with max_levels=2) included."
            )
        elif self.recompute:
            parts.append(
                "Multi-level plans (policy='optimal' with max_levels=2) hold fewer block boundaries than `full` and may "
                "need less, but they are planned from a profile, and profiling needs at least this pass under "
                "checkpointing: they cannot be profiled within this budget either."
            )
        elif self.why:
            parts.append("The `full` plan's peak could not be measured: a block cannot be run again as its forward ran.")
        smaller = f" (to {self.largest_batch})" if self.largest_batch and self.largest_batch < self.batch_size else ""
        shorter = f" (to {self.longest_tokens} tokens)" if self.longest_tokens else ""
        parts.append(
            f"Raise memory_budget above {format_bytes(self.at_least_bytes)}, or lower target_batch_size{smaller} or "
            f"the sequence length{shorter}."
        )
        return " ".join(parts)


class ProfileRefused(InfeasibleBudgetError):
    """No pass that measures the step fits the memory budget (`shortfall` says what was measured)."""

    def __init__(self, shortfall: Shortfall, message: str | None = None) -> None:
        super().__init__(message or shortfall.message())
        self.shortfall = shortfall


def longest_prefix(
    length: int, pass_at: Callable[[int], int | None], passes: int = SEARCH_PASSES, lo: int = 0,
) -> tuple[int, int, dict[int, int]]:
    """The longest prefix of a sequence of `length` tokens whose pass fits, `length` itself known not to (and
    `lo` known to, when not 0): `pass_at(x)` runs the bounded pass on the first `x` tokens and gives the bytes
    it held (None: stopped). -> (the longest that fit, 0 when none did; the shortest tried; {length: bytes}
    of those tried that fit).

    [search] halve until a prefix fits, then bisect between it and the shortest that did not, `passes` in all."""
    hi, tried, held = length, length, {}
    for _ in range(passes):
        x = hi // 2 if lo == 0 else (lo + hi) // 2
        if x < 1 or x <= lo:
            break
        tried = min(tried, x)
        got = pass_at(x)
        if got is None:
            hi = x
        else:
            lo, held[x] = x, got
    return lo, tried, held
