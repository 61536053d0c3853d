"""Exact 0/1 knapsack on integer weights: bounds, reduction, core DP, fallback.

Sources: Dantzig (1957) LP bound; LP-bound variable fixing (Ingargiola and Korsh
1973; Martello and Toth 1990, sec. 2.7); the core DP of `_core`. Effort is bounded:
past a state budget the core is re-solved on a coarser grid, and the slack is reported.
"""

from __future__ import annotations

import numpy as np

from lightning_ckpt.solvers._core import (
    BudgetExceeded,
    Sorted,
    expand_core,
    flip_bounds,
    sort_by_ratio,
)
from lightning_ckpt.solvers._intmodel import IntModel, integer_model

__all__ = ["DEFAULT_STATE_BUDGET", "IntModel", "integer_model", "solve_int"]

# Effort budget: DP states generated before the core is re-solved on a coarser grid.
DEFAULT_STATE_BUDGET = 10_000_000
# A first, cheap attempt without the surrogate bound gets this many states.
_CHEAP_ATTEMPT = 200_000
# Coarser grids tried after the budget runs out: capacity of about 2**bits steps.
_COARSE_GRID_BITS = (24, 16, 10)


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
