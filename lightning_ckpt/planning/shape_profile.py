"""Step costs across batch shapes: one `Profile` (a line in the batch size) per profiled length
of the dimension that varies between batches (a padded sequence length, an image side), and a
polynomial in that length through them.

At a fixed batch size every byte and FLOP count of a block is a polynomial of low degree in the
length: linear for matmuls, layer norms and dropout, quadratic where attention materialises its
scores. `ShapeProfile.at(batch, length)` evaluates the profile of a profiled length directly, and
elsewhere a least-squares polynomial of degree at most 2 through the profiled lengths, field by
field. `fit_error` checks that polynomial by leaving each profiled length out in turn and
predicting it from the others; a length is `covered` (the fit may stand in for profiling it) only
inside the profiled range and when that check is within its tolerance. Plain data, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import _CHECKED, _CHECKED_STEP, _STEP_LINEAR, Profile
from lightning_ckpt.planning.cost_combination import CostCombination, combine_costs

FIT_TOLERANCE = 0.01  # worst leave-one-out miss (share of the step's checked bytes) under which the fit is trusted
MIN_FIT_LENGTHS = 4  # the leave-one-out check of a quadratic needs three lengths left in


def _weights(xs: Sequence[float], x: float) -> tuple[float, ...]:
    """The least-squares polynomial of degree min(2, len(xs) - 1) through (xs, ys), evaluated at x, is
    linear in ys: these are its coefficients, computed once for every quantity fitted at x."""
    scale = max(xs)
    u = np.asarray(xs, dtype=float) / scale
    degree = min(2, len(xs) - 1)
    vander = np.vander(u, degree + 1, increasing=True)
    at = np.vander(np.asarray([x / scale]), degree + 1, increasing=True)[0]
    return tuple(float(w) for w in at @ np.linalg.pinv(vander))


def fit_costs(costs: Sequence[StepCost], lengths: Sequence[int], length: int) -> StepCost:
    """The step cost at `length` from costs at the same batch size and other `lengths`."""
    return combine_costs(costs, _weights([float(v) for v in lengths], float(length)))


def checked_bytes(cost: StepCost) -> list[float]:
    """The quantities the fit is checked on, in a fixed order: every block's saved and input bytes,
    the bytes before and after the chain and the batch."""
    out = [float(getattr(b, f)) for b in cost.blocks for f in ("saved_bytes", "input_bytes")]
    return out + [float(getattr(cost, f)) for f in _STEP_LINEAR]


def held_bytes(cost: StepCost) -> list[float]:
    """Every size the memory model holds (`linear_fit._CHECKED`, as the check slice of a profile): the checked
    bytes with the blocks' transients. A transient can be the larger of a fixed buffer (a weight's gradient)
    and an activation, which no polynomial in the size follows: its miss is held in reserve as bytes
    (`ShapeProfile.transient_miss_bytes`), not checked against the tolerance, which is a share of the
    checked bytes (a fixed buffer's miss at a short length would be a large share of little)."""
    out = [float(getattr(b, f) or 0) for b in cost.blocks for f in _CHECKED]
    return out + [float(getattr(cost, f) or 0) for f in _CHECKED_STEP]


def worst_misses(predicted: np.ndarray, measured: np.ndarray, checked: int) -> tuple[float, float]:
    """(the largest miss of the first `checked` quantities as a share of their measured sum (what the step's
    saved and boundary bytes are made of), the largest miss of all of them in bytes)."""
    miss = np.abs(np.maximum(0.0, np.rint(predicted)) - measured)
    total = float(measured[:checked].sum())
    return (float(miss[:checked].max()) / total if total > 0 else 0.0), float(miss.max())


def stacked(costs: Sequence[StepCost]) -> tuple[np.ndarray, int]:
    """Per cost (rows), the checked quantities then the others the memory model holds; -> (rows, how many
    are checked)."""
    rows = [checked_bytes(c) + held_bytes(c) for c in costs]
    return np.array(rows, dtype=float), len(checked_bytes(costs[0]))


@dataclass(frozen=True)
class ShapeProfile:
    """Profiles at several lengths of the varying dimension (ascending, distinct), all with the
    same blocks. With one length it is that length's profile; with more, `at` interpolates."""

    profiles: tuple[tuple[int, Profile], ...]
    _errors: dict = field(default_factory=dict, compare=False, repr=False)  # batch size -> (fit_error, transient_miss_bytes)
    _fitted: dict = field(default_factory=dict, compare=False, repr=False)  # fitted costs already asked for

    def __post_init__(self) -> None:
        lengths = [x for x, _ in self.profiles]
        if not lengths:
            raise ValueError("a ShapeProfile needs at least one profiled length.")
        if any(x < 1 for x in lengths) or lengths != sorted(set(lengths)):
            raise ValueError(f"profiled lengths must be distinct positive integers in ascending order, got {lengths}.")
        blocks = {p.n_blocks for _, p in self.profiles}
        if len(blocks) != 1:
            raise ValueError(f"profiles at different lengths disagree on the number of blocks: {sorted(blocks)}.")

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(x for x, _ in self.profiles)

    @property
    def n_blocks(self) -> int:
        return self.profiles[0][1].n_blocks

    def with_profile(self, length: int, profile: Profile) -> "ShapeProfile":
        """This one with `profile` at `length` added (replacing an earlier one at that length)."""
        kept = {x: p for x, p in self.profiles if x != length}
        kept[length] = profile
        return ShapeProfile(tuple(sorted(kept.items())))

    def profile_at(self, length: int) -> Profile | None:
        return dict(self.profiles).get(length)

    def at(self, batch_size: int, length: int, **step_fields) -> StepCost:
        """The step cost at `batch_size` and `length` (static fields passed through)."""
        exact = self.profile_at(length)
        if exact is not None:
            return exact.at(batch_size, **step_fields)
        if len(self.profiles) == 1:
            raise ValueError(
                f"length {length} was not profiled and one profiled length ({self.lengths[0]}) cannot be "
                "extrapolated; profile that length too."
            )
        fields = tuple(sorted(step_fields.items()))
        key = (batch_size, length, fields)
        if key not in self._fitted:
            if (batch_size, fields) not in self._fitted:  # each profile's line at this batch, gathered once for every length
                self._fitted[(batch_size, fields)] = CostCombination([p.at(batch_size, **step_fields) for _, p in self.profiles])
            w = _weights([float(v) for v in self.lengths], float(length))  # as `fit_costs`
            self._fitted[key] = self._fitted[(batch_size, fields)].combine(w)
        return self._fitted[key]

    def fit_error(self, batch_size: int) -> float | None:
        """Worst leave-one-out miss at `batch_size`: the largest miss of any block's saved or boundary
        bytes, or of the bytes around the chain, as a share of all those bytes at the length left out
        (what the step's peak is made of); None with fewer than `MIN_FIT_LENGTHS` lengths, when the
        check cannot test a quadratic."""
        if len(self.profiles) < MIN_FIT_LENGTHS:
            return None
        if batch_size not in self._errors:
            self._errors[batch_size] = self._leave_one_out(batch_size)
        return self._errors[batch_size][0]

    def transient_miss_bytes(self, batch_size: int) -> int | None:
        """The worst leave-one-out miss, in bytes, of any size the memory model holds, transients included
        (`held_bytes`): held in reserve by a cost from the fit beside the share `fit_error` of the checked bytes."""
        if self.fit_error(batch_size) is None:
            return None
        return int(math.ceil(self._errors[batch_size][1]))

    def _leave_one_out(self, batch_size: int) -> tuple[float, float]:
        """Each profiled length predicted from the others, one least-squares solve per length over all
        the quantities at once -> (worst miss of the checked ones as a share, of all in bytes)."""
        values, checked = stacked([p.at(batch_size) for _, p in self.profiles])  # lengths x quantities
        xs = np.asarray(self.lengths, dtype=float) / max(self.lengths)
        worst, reserve = 0.0, 0.0
        for k in range(len(xs)):
            rest = np.arange(len(xs)) != k
            coef = np.polynomial.polynomial.polyfit(xs[rest], values[rest], min(2, int(rest.sum()) - 1))
            miss, every = worst_misses(np.polynomial.polynomial.polyval(xs[k], coef), values[k], checked)
            worst, reserve = max(worst, miss), max(reserve, every)
        return worst, reserve

    def covers(self, length: int, batch_size: int, tolerance: float = FIT_TOLERANCE) -> bool:
        """Whether the fit may stand in for a profile at `length`: inside the profiled range, with a
        leave-one-out check within `tolerance` (also at a profiled length: the points may disagree)."""
        if not self.lengths[0] <= length <= self.lengths[-1]:
            return False
        err = self.fit_error(batch_size)
        return err is not None and err <= tolerance

    def to_dict(self) -> dict:
        return {"profiles": [{"length": x, "profile": p.to_dict()} for x, p in self.profiles]}

    @classmethod
    def from_dict(cls, data: dict) -> "ShapeProfile":
        return cls(tuple((int(e["length"]), Profile.from_dict(e["profile"])) for e in data["profiles"]))
