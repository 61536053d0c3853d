"""Integer stand-ins for float memory sizes, with a stated rounding guarantee.

Either an exact binary rescaling (every float is an integer times a power of two)
or, when that overflows int64, memory rounded *up* to 2**40 steps of the budget,
so integer feasibility implies feasibility on the real float values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

_GRID_BITS = 40


@dataclass(frozen=True)
class IntModel:
    """Integer weights `a` and capacity `cap` standing for the float problem.

    a[i] >= w[i] / step and cap <= C / step, so an integer-feasible selection is
    feasible on the real weights. `slack` is the per-item capacity slack of the
    converse: any T with sum(w[T]) <= C - |T| * slack is integer-feasible.
    """

    a: np.ndarray
    cap: int
    step: float
    slack: float


def integer_model(w: np.ndarray, cap: float) -> IntModel:
    """Exact binary scaling when it fits in int64, else a ceil-rounded 2**40 grid.

    `w` must be positive, finite and <= `cap`, with `cap` finite.
    """
    exact = _exact_scaling(w, cap)
    return exact if exact is not None else _grid_scaling(w, cap)


def _exact_scaling(w: np.ndarray, cap: float) -> IntModel | None:
    vals = np.append(w, cap)
    mant, expo = np.frexp(vals)
    mant_int = np.ldexp(mant, 53).astype(np.int64)  # exact: 53-bit mantissas
    low_bit = mant_int & -mant_int
    zeros = np.log2(low_bit.astype(np.float64)).astype(np.int64)
    lowest = int((expo.astype(np.int64) - 53 + zeros).min())
    with np.errstate(over="ignore"):
        scaled = np.ldexp(vals, -lowest)  # exact: only the exponent moves
    if not np.isfinite(scaled).all() or scaled.max() >= 2.0**62:
        return None
    if math.fsum(scaled[:-1].tolist()) >= 2.0**61:
        return None
    ints = scaled.astype(np.int64)
    return IntModel(ints[:-1], int(ints[-1]), math.ldexp(1.0, lowest), 0.0)


def _grid_scaling(w: np.ndarray, cap: float) -> IntModel:
    bits = min(_GRID_BITS, 61 - max(len(w), 1).bit_length())
    t = np.ldexp(w / cap, bits)  # t = w * 2**bits / cap up to one rounding
    up = np.ceil(t * (1 + 2.0**-50))
    down = np.ceil(t * (1 - 2.0**-50))
    a = up
    for i in np.flatnonzero(up != down).tolist():  # near an integer: decide exactly
        a[i] = math.ceil(Fraction(float(w[i])) * 2**bits / Fraction(cap))
    a = np.maximum(a, 1).astype(np.int64)
    step = math.ldexp(cap, -bits)
    return IntModel(a, 2**bits, step, step)
