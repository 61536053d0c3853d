"""Exact 0/1 knapsack on integer weights: the integer model, bounds, reduction, core DP.

Sources: Dantzig (1957) LP bound; LP-bound variable fixing (Ingargiola and Korsh
1973; Martello and Toth 1990, sec. 2.7); the core DP of `_core`. Effort is bounded:
past a state budget the core is re-solved on a coarser grid, and the slack is reported.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np

from lightning_ckpt.solvers._core import (
    BudgetExceeded,
    Sorted,
    expand_core,
    flip_bounds,
    sort_by_ratio,
)
from lightning_ckpt.solvers._intmodel import IntModel, integer_model

__all__ = ["DEFAULT_STATE_BUDGET", "IntModel", "fit_model", "integer_model", "solve_int"]

# Effort budget: DP states generated before the core is re-solved on a coarser grid.
DEFAULT_STATE_BUDGET = 10_000_000
# A first, cheap attempt without the surrogate bound gets this many states.
_CHEAP_ATTEMPT = 200_000
# Coarser grids tried after the budget runs out: capacity of about 2**bits steps.
_COARSE_GRID_BITS = (24, 16, 10)
# Decimal units tried for memory: 10**-j for j = 0..15.
_DECIMAL_DIGITS = 15
# Relative distance of memory * 10**j from a whole number still read as that number:
# representation noise of a value made by a few float operations (k * 1e-4, b / 1e9).
_UNIT_NOISE = 2.0**-48


def fit_model(w: np.ndarray, cap: float, limit: float) -> IntModel:
    """Integer model of "real sum of `w` <= `limit`" (`limit` = budget_limit(`cap`)).

    An exact binary scaling when one fits in int64 (slack 0); else whole decimal units
    when every weight is one up to representation noise (slack 0); else memory rounded
    up to 2**40 steps of `cap` (slack: one step per item). The first and last are built
    on `cap`, so that the limit's low bits do not shrink the binary scaling, and widened.
    """
    model = integer_model(w, cap)
    if model.slack > 0:
        decimal = _decimal_model(w, limit)
        if decimal is not None:
            return decimal
    # [constraint] a[i] * step >= w[i], so sum(a) <= floor(limit / step) keeps the real
    # sum <= limit; with an exact scaling (a[i] * step == w[i]) the converse holds too.
    widened = math.floor(Fraction(limit) / Fraction(model.step))
    return dataclasses.replace(model, cap=max(widened, model.cap))


def _decimal_model(w: np.ndarray, limit: float) -> IntModel | None:
    """Memory in whole units of 10**-j (the coarsest that fits), or None.

    [constraint] if |w[i] * 10**j - k[i]| <= (_UNIT_NOISE + 2**-52) * k[i] for every
    item, and limit * 10**j is farther than 4 * _UNIT_NOISE * max(limit * 10**j, 1) from
    every whole number, then a selection's real memory sum is <= limit iff its k sum to
    at most floor(limit * 10**j): noise moves no sum across that gap.
    """
    for j in range(_DECIMAL_DIGITS + 1):
        scale = 10.0**j  # exact in float64
        with np.errstate(over="ignore", invalid="ignore"):  # inf: never a whole unit
            ws = w * scale
            k = np.rint(ws)
            if not (np.abs(ws - k) <= _UNIT_NOISE * k).all():
                continue
        ls = limit * scale
        if ls >= 2.0**52 or float(k.sum()) >= 2.0**61:
            return None
        m = math.floor(ls)
        if min(ls - m, m + 1 - ls) <= 4 * _UNIT_NOISE * max(ls, 1.0):
            return None  # the limit itself sits on the grid, up to noise: undecided
        return IntModel(k.astype(np.int64), m, 1.0 / scale, 0.0)
    return None


def _greedy_fill(s: Sorted, cap: int) -> np.ndarray:
    """Break solution plus every later item that still fits (a lower bound)."""
    take = np.zeros(len(s.a), dtype=bool)
    take[: s.brk] = True
    room = cap - int(s.pw[s.brk])
    rest = s.a[s.brk + 1 :]
    if rest.size == 0:
        return take
    suffix_min = np.minimum.accumulate(rest[::-1])[::-1].tolist()
    for j, aj in enumerate(rest.tolist()):
        if room < suffix_min[j]:
            break
        if aj <= room:
            room -= aj
            take[s.brk + 1 + j] = True
    return take


def solve_int(model: IntModel, v: np.ndarray, margin: float,
              budget: int) -> tuple[np.ndarray, int, float]:
    """Best selection (bool mask) of the integer problem, to within `margin`.

    Returns (mask, states generated, per-item capacity slack of the guarantee);
    the slack exceeds the model's own only when the effort fallback coarsened the
    grid.
    """
    a, cap = model.a, model.cap
    s = sort_by_ratio(a, v, cap)
    if s.brk == len(a):
        return np.ones(len(a), dtype=bool), 0, model.slack
    mask_sorted = _greedy_fill(s, cap)
    best = float(s.v[mask_sorted].sum())
    upper = float(s.pv[s.brk]) + (cap - int(s.pw[s.brk])) * float(s.ratio[s.brk])
    if upper <= best + margin:  # [bound] greedy already meets the Dantzig bound
        return _unsort(s, mask_sorted), 0, model.slack
    fixed = flip_bounds(s, cap) <= best + margin  # [fixing] flips that cannot pay
    before = np.arange(len(a)) < s.brk
    fix_in = fixed & before
    core = np.flatnonzero(~fixed)
    core_cap = cap - int(s.a[fix_in].sum())
    core_target = best - float(s.v[fix_in].sum())
    states = 0
    attempts = _attempts(core_cap, len(core), budget)
    for n_try, (shift, strong, limit) in enumerate(attempts):
        last = n_try == len(attempts) - 1
        a_core = s.a[core] if shift == 0 else (s.a[core] + (1 << shift) - 1) >> shift
        try:
            found, used = expand_core(a_core, s.v[core], core_cap >> shift, core_target,
                                      margin, None if last else limit, strong)
        except BudgetExceeded as exc:
            states += int(exc.args[0])
            continue
        states += used
        slack = model.slack
        if shift > 0:
            # [slack] ceil(a / 2**shift) loses at most one coarse step per item
            slack += model.step * (1 << shift)
        if found is not None:
            mask_sorted = fix_in.copy()
            mask_sorted[core[found]] = True
        return _unsort(s, mask_sorted), states, slack
    raise AssertionError("unreachable: the last attempt runs without a budget")


def _attempts(cap: int, m: int, budget: int) -> list[tuple[int, bool, int]]:
    """(grid shift, surrogate bound on?, state budget) to try in turn.

    Cheap bounds first, then the surrogate bound, then ever coarser grids (about
    2**24, 2**16 and 2**10 steps of capacity) with a quarter of the budget each;
    the last runs to the end (its states are bounded by the grid).
    """
    out = [(0, False, min(budget, max(_CHEAP_ATTEMPT, 20 * m))), (0, True, budget)]
    shifts = sorted({max(cap.bit_length() - bits, 1) for bits in _COARSE_GRID_BITS})
    out += [(shift, True, max(budget // 4, 1)) for shift in shifts]
    return out


def _unsort(s: Sorted, mask_sorted: np.ndarray) -> np.ndarray:
    mask = np.zeros_like(mask_sorted)
    mask[s.order] = mask_sorted
    return mask
