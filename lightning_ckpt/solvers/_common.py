"""Input checks and exact-arithmetic functions shared by the knapsack solvers.

Turns ``(memory, runtimes, max_memory)`` into float64 arrays (or says why it cannot),
splits off items whose fate the problem statement fixes, and holds the one definition
of "fits" that every solver in this package uses (`fits`, over `budget_limit`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

Result = tuple[float, list[int], list[int]]

# Memory a selection may exceed the budget by, as a power of two of the budget: 2**-40
# (about 9.1e-13) is representation noise, not excess (see `fits`).
FIT_ALLOWANCE_LOG2 = -40


def as_problem(
    memory: Sequence[float], runtimes: Sequence[float], max_memory: float, solver: str
) -> tuple[np.ndarray, np.ndarray, float]:
    """Return float64 copies of the inputs after checking that they make sense.

    Raises ValueError naming the offending entry, why a knapsack cannot use it,
    and what to pass instead.
    """
    w = _as_vector(memory, "memory", solver)
    v = _as_vector(runtimes, "runtimes", solver)
    if w.shape != v.shape:
        raise ValueError(
            f"{solver}: got {w.size} memory entries but {v.size} runtimes; every item "
            "needs exactly one of each (same order), so pass lists of equal length."
        )
    _check_entries(w, "memory", solver, allow_inf=True)
    _check_entries(v, "runtimes", solver, allow_inf=False)
    try:
        cap = float(max_memory)
    except (TypeError, ValueError):
        raise ValueError(
            f"{solver}: max_memory={max_memory!r} is not a number; pass the memory "
            "budget as a float in the same unit as `memory`."
        ) from None
    if math.isnan(cap) or cap < 0:
        raise ValueError(
            f"{solver}: max_memory={cap!r} is not a usable budget (it must be a number "
            ">= 0, and NaN or a negative value admits no selection); pass 0.0 to "
            "recompute everything that takes memory."
        )
    return w, v, cap


def _as_vector(values: Sequence[float], name: str, solver: str) -> np.ndarray:
    try:
        arr = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"{solver}: {name} could not be read as a list of numbers (got "
            f"{type(values).__name__}); pass a flat list of floats, one per item."
        ) from None
    if arr.ndim != 1:
        raise ValueError(
            f"{solver}: {name} has shape {arr.shape}, but the solver needs one number "
            "per item; pass a flat list."
        )
    return arr


def _check_entries(arr: np.ndarray, name: str, solver: str, allow_inf: bool) -> None:
    bad = np.isnan(arr) | (arr < 0)
    if not allow_inf:
        bad |= np.isinf(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        allowed = "finite and >= 0" if not allow_inf else ">= 0 (not NaN)"
        raise ValueError(
            f"{solver}: {name}[{i}] = {float(arr[i])!r}, but every entry must be {allowed}; "
            f"a knapsack cannot weigh a negative, NaN or infinite {name} against the "
            "others. Fix the cost model upstream (clamp estimates at 0)."
        )


def split_trivial(
    w: np.ndarray, v: np.ndarray, cap: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split items into (always saved, never saved, to decide).

    Zero-memory items with positive runtime are free: always saved. Items with
    zero runtime gain nothing: never saved. Items that do not fit the budget alone
    (heavier than ``budget_limit(cap)``) cannot be saved. Everything else is left to
    the solver.
    """
    free_gain = (w == 0) & (v > 0)
    useless = (v == 0) | (w > budget_limit(cap))
    decide = ~(free_gain | useless)
    return np.flatnonzero(free_gain), np.flatnonzero(useless), np.flatnonzero(decide)


def budget_limit(cap: float) -> float:
    """The largest real memory sum that fits budget `cap`: ``cap + cap * 2**-40`` in float64.

    0 stays 0, inf stays inf, a finite budget a finite limit. For whole numbers (byte
    counts) with ``cap < 2**39`` the limit is below ``cap + 1``, so an integer sum fits
    iff it is <= `cap`.
    """
    return min(cap + math.ldexp(cap, FIT_ALLOWANCE_LOG2), max(cap, sys.float_info.max))


def fits(weights: Sequence[float], cap: float) -> bool:
    """Whether a selection with these memory values fits budget `cap`: the definition.

    True iff the exact real sum of the float64 `weights` is <= ``budget_limit(cap)``,
    about 1e-12 relative above `cap`. The allowance absorbs representation noise: sizes
    that are whole multiples of a decimal unit (k x 1e-4) are stored with relative errors
    near 1e-16, so the real sum of a selection that meets the budget exactly in those
    units can land a few ulps above the stored budget (``3 * 1e-4 + 2 * 1e-4`` exceeds
    ``5 * 1e-4`` by 5e-20). Integer sums against integer budgets below 2**39 are decided
    exactly as ``sum <= cap``.
    """
    return fits_exactly(weights, budget_limit(cap))


def fits_exactly(weights: Sequence[float], cap: float) -> bool:
    """True iff the exact real sum of `weights` is <= `cap` (no allowance: see `fits`).

    ``math.fsum`` is correctly rounded, so a strict comparison against the float
    `cap` settles every case except a rounded sum equal to `cap`; that tie is
    decided in rational arithmetic.
    """
    if math.isinf(cap):
        return True
    total = math.fsum(weights)
    if total != cap:
        return total < cap
    exact = sum((Fraction(x) for x in weights), Fraction(0))
    return exact <= Fraction(cap)


def make_result(value_of: np.ndarray, saved: np.ndarray, n: int) -> Result:
    """Build ``(value, saved, recomputed)`` with both index lists ascending.

    The value is ``math.fsum`` of the saved runtimes, so it always equals the sum
    over the returned selection (correctly rounded).
    """
    mask = np.zeros(n, dtype=bool)
    mask[saved] = True
    saved_idx = np.flatnonzero(mask)
    value = math.fsum(value_of[saved_idx].tolist())
    return value, saved_idx.tolist(), np.flatnonzero(~mask).tolist()
