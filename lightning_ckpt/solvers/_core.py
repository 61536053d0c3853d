"""Expanding-core dynamic programme over Pareto states, with LP-based pruning.

Sources: Pisinger, "A minimal algorithm for the 0-1 knapsack problem" (1997): core
and state bounds; Martello, Pisinger and Toth (1999), "Dynamic programming and strong
bounds for the 0-1 knapsack problem": surrogate cardinality bound (runtime ~ memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Stands for an infinite ratio (nothing left to drop) without 0 * inf = nan.
_HUGE = 1e300


class BudgetExceeded(Exception):
    """The Pareto states grew past the effort budget (args[0]: states generated)."""


@dataclass
class Sorted:
    """Items in decreasing runtime/weight order with prefix sums."""

    order: np.ndarray
    a: np.ndarray
    v: np.ndarray
    ratio: np.ndarray
    pw: np.ndarray  # pw[k] = weight of the first k items
    pv: np.ndarray
    brk: int  # the first `brk` items fit, item `brk` does not (brk == m: all fit)


def sort_by_ratio(a: np.ndarray, v: np.ndarray, cap: int) -> Sorted:
    ratio = v / a
    order = np.argsort(-ratio, kind="stable")
    a_s, v_s = a[order], v[order]
    pw = np.concatenate(([0], np.cumsum(a_s)))
    pv = np.concatenate(([0.0], np.cumsum(v_s)))
    brk = int(np.searchsorted(pw, cap, side="right")) - 1
    return Sorted(order, a_s, v_s, ratio[order], pw, pv, brk)


def lp_bound(s: Sorted, caps: np.ndarray) -> np.ndarray:
    """Dantzig bound: greedy fill by ratio, the first misfit taken fractionally."""
    # [bound] LP(c) = pv[k] + (c - pw[k]) * ratio[k], k = number of items that fit in c
    m = len(s.a)
    k = np.searchsorted(s.pw, caps, side="right") - 1
    frac = np.where(k < m, (caps - s.pw[k]) * s.ratio[np.minimum(k, m - 1)], 0.0)
    return s.pv[k] + frac


def flip_bounds(s: Sorted, cap: int) -> np.ndarray:
    """Upper bound on any selection that flips item j away from the break solution."""
    b = s.brk
    # [fixing] x_j = 0 for j < brk: LP over the other items = LP(cap + a_j) - v_j
    drop = lp_bound(s, cap + s.a[:b]) - s.v[:b]
    # [fixing] x_j = 1 for j >= brk: v_j + LP(cap - a_j) bounds every such selection
    add = s.v[b:] + lp_bound(s, cap - s.a[b:])
    return np.concatenate((drop, add))


@dataclass
class Surrogate:
    """Capacity and a cardinality bound merged into one constraint.

    lam >= 0: sum(x) <= k (k = most items that fit), lam < 0: sum(x) >= k (k = fewest
    items that can beat the incumbent); either way sum((a + lam) x) <= cap + lam k.
    """

    lam: float
    k: int
    add_max: np.ndarray  # add_max[h] = max ratio v / (a + lam) over items >= h
    drop_min: np.ndarray  # drop_min[l] = min ratio over items < l


def surrogate(s: Sorted, cap: int, target: float, steps: int = 40) -> Surrogate | None:
    """Multiplier lam minimising the surrogate LP bound, or None if it does not help."""
    k_max = int(np.searchsorted(np.cumsum(np.sort(s.a)), cap, side="right"))
    top_v = np.cumsum(np.sort(s.v)[::-1])
    k_min = int(np.searchsorted(top_v, target, side="right")) + 1
    if k_min > k_max:
        return None  # no selection beats the incumbent: the DP ends at once anyway
    side = {True: k_max, False: k_min}
    candidates = [(0.0, surrogate_lp(s, cap, 0.0, k_max))]
    for lo, hi in ((0.0, 2.0 * float(s.a.max())), (-float(s.a.min()) * (1 - 2.0**-20), 0.0)):
        lam = _golden(lambda x: surrogate_lp(s, cap, x, side[x >= 0]), lo, hi, steps)
        # The bound is piecewise linear in lam with kinks where two ratios tie; the
        # minimum sits on a kink (e.g. lam = K when runtime = memory + K): snap to it.
        for cand in [lam] + _tie_points(s, lam, side[lam >= 0], cap):
            if lo <= cand <= hi:
                candidates.append((cand, surrogate_lp(s, cap, cand, side[cand >= 0])))
    lam, best = min(candidates, key=lambda c: c[1])
    if not best < candidates[0][1]:
        return None
    r = s.v / (s.a + lam)
    add_max = np.concatenate((np.maximum.accumulate(r[::-1])[::-1], [0.0]))
    drop_min = np.concatenate(([np.inf], np.minimum.accumulate(r)))
    return Surrogate(lam, side[lam >= 0], add_max, drop_min)


def surrogate_lp(s: Sorted, cap: int, lam: float, k: int) -> float:
    """Dantzig bound of the surrogate problem: weights a + lam, capacity cap + lam k."""
    w = s.a + lam
    room = cap + lam * k
    if room < 0:
        return -np.inf  # the cardinality bound cannot be met: nothing beats the target
    r = s.v / w
    o = np.argsort(-r, kind="stable")
    pw, pv = np.cumsum(w[o]), np.cumsum(s.v[o])
    j = int(np.searchsorted(pw, room, side="right"))
    if j == len(o):
        return float(pv[-1])
    done_w, done_v = (pw[j - 1], pv[j - 1]) if j else (0.0, 0.0)
    return float(done_v + (room - done_w) * r[o[j]])


def _golden(f, lo: float, hi: float, steps: int) -> float:
    """Golden-section search for the minimum of a unimodal f on [lo, hi]."""
    g = (5**0.5 - 1) / 2
    x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
    f1, f2 = f(x1), f(x2)
    for _ in range(steps):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - g * (hi - lo)
            f1 = f(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + g * (hi - lo)
            f2 = f(x2)
    return x1 if f1 <= f2 else x2


def _tie_points(s: Sorted, lam: float, k: int, cap: int, width: int = 8) -> list[float]:
    """Multipliers where neighbours around the surrogate break item tie."""
    w = s.a + lam
    o = np.argsort(-(s.v / w), kind="stable")
    j = int(np.searchsorted(np.cumsum(w[o]), cap + lam * k, side="right"))
    idx = o[max(j - width, 0) : j + width + 1]
    a1, v1, a2, v2 = s.a[idx[:-1]], s.v[idx[:-1]], s.a[idx[1:]], s.v[idx[1:]]
    # [tie] v1 / (a1 + t) = v2 / (a2 + t)  <=>  t = (v1 a2 - v2 a1) / (v2 - v1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (v1 * a2 - v2 * a1) / (v2 - v1)
    return sorted({float(x) for x in t if np.isfinite(x)})


@dataclass
class _Stages:
    """Back-pointers of every DP stage, for rebuilding the chosen selection."""

    item: list[int]
    parent: list[np.ndarray]
    flipped: list[np.ndarray]

    def flips_of(self, stage: int, parent: int, flipped: bool) -> list[int]:
        out = [self.item[stage]] if flipped else []
        for st in range(stage - 1, 0, -1):
            if self.flipped[st][parent]:
                out.append(self.item[st])
            parent = int(self.parent[st][parent])
        return out


def expand_core(a: np.ndarray, v: np.ndarray, cap: int, target: float, margin: float,
                budget: int | None, use_surrogate: bool = False) -> tuple[np.ndarray | None, int]:
    """Pareto DP grown outward from the break item (Pisinger's expanding core).

    Returns (indices of a selection worth more than target + margin, or None if
    there is none; states generated). Raises BudgetExceeded(states).
    """
    if len(a) == 0:
        return None, 0
    s = sort_by_ratio(a, v, cap)
    m = len(a)
    if s.brk == m:  # everything fits
        return (s.order if float(s.pv[m]) > target + margin else None), 0
    sur = surrogate(s, cap, target + margin) if use_surrogate else None
    weights = np.array([s.pw[s.brk]], dtype=np.int64)
    values = np.array([s.pv[s.brk]])
    counts = np.array([s.brk], dtype=np.int64)
    stages = _Stages([-1], [np.array([-1])], [np.array([False])])
    best: tuple[int, int, bool] | None = None
    if weights[0] <= cap and values[0] > target + margin:
        target, best = float(values[0]), (0, 0, False)
    flip_bound = flip_bounds(s, cap)
    lo, hi, turn, used = s.brk, s.brk, 0, 0
    while weights.size and (lo > 0 or hi < m):
        add = hi < m and (lo == 0 or turn == 0)
        turn ^= 1
        j = hi if add else lo - 1
        hi, lo = (hi + 1, lo) if add else (hi, lo - 1)
        if flip_bound[j] <= target + margin:
            continue  # [fixing] flipping j cannot beat the incumbent: leave it as is
        sign = 1 if add else -1
        # [recurrence] state (W, V, c) -> (W + a_j, V + v_j, c + 1) if j is added,
        #              (W - a_j, V - v_j, c - 1) if j leaves the break solution
        k = weights.size
        used += 2 * k
        if budget is not None and used > budget:
            raise BudgetExceeded(used)
        all_w, all_v = _branch(weights, values, sign * int(s.a[j]), sign * float(s.v[j]))
        order, w_s, v_s, keep = _pareto(all_w, all_v)
        pos = int(np.searchsorted(w_s, cap, side="right")) - 1
        if pos >= 0:
            i = int(np.argmax(v_s[: pos + 1]))  # first maximum: an undominated state
            if v_s[i] > target + margin:
                target = float(v_s[i])
                best = (len(stages.item), int(order[i] % k), bool(order[i] >= k))
        ub = _bound(s, w_s, v_s, cap, lo, hi)
        if sur is not None:
            c_s = np.concatenate((counts, counts + sign))[order]
            ub_sur = _surrogate_bound(sur, w_s, v_s, c_s, cap, lo, hi)
            if ub_sur is not None:
                np.minimum(ub, ub_sur, out=ub)
        live = keep & (ub > target + margin)
        idx = order[live]
        weights, values = w_s[live], v_s[live]
        if sur is not None:
            counts = c_s[live]
        stages.item.append(j)
        stages.parent.append((idx % k).astype(np.int32))
        stages.flipped.append(idx >= k)
    if best is None:
        return None, used
    take = np.zeros(m, dtype=bool)
    take[: s.brk] = True
    for j in stages.flips_of(*best):
        take[j] = not take[j]
    return s.order[take], used


def _branch(w: np.ndarray, v: np.ndarray, dw: int, dv: float) -> tuple[np.ndarray, np.ndarray]:
    """States followed by the same states with the item flipped."""
    k = w.size
    all_w = np.empty(2 * k, dtype=np.int64)
    all_v = np.empty(2 * k)
    all_w[:k], all_v[:k] = w, v
    np.add(w, dw, out=all_w[k:])
    np.add(v, dv, out=all_v[k:])
    return all_w, all_v


def _pareto(all_w: np.ndarray, all_v: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sort states by weight; flag the undominated ones (lighter or more valuable).

    Returns (order, sorted weights, sorted values, keep mask); values of tied
    losers are set to -inf so that a first maximum is always a kept state.
    """
    order = np.argsort(all_w, kind="stable")  # two sorted runs: a linear merge
    w_sorted, v_sorted = all_w[order], all_v[order]
    ties = np.flatnonzero(w_sorted[1:] == w_sorted[:-1])
    if ties.size:  # equal weights come in pairs: keep the more valuable one
        loser = np.where(v_sorted[ties + 1] >= v_sorted[ties], ties, ties + 1)
        v_sorted[loser] = -np.inf
    # [dominance] keep a state only if it beats every lighter state
    running = np.maximum.accumulate(v_sorted)
    keep = np.empty(v_sorted.size, dtype=bool)
    keep[0] = v_sorted[0] > -np.inf
    np.greater(v_sorted[1:], running[:-1], out=keep[1:])
    return order, w_sorted, v_sorted, keep


def _bound(s: Sorted, w: np.ndarray, v: np.ndarray, cap: int, lo: int, hi: int) -> np.ndarray:
    """Dantzig bound on every completion (items outside [lo, hi) may still flip)."""
    room = (cap - w).astype(np.float64)
    r_add = float(s.ratio[hi]) if hi < len(s.a) else 0.0
    r_drop = float(s.ratio[lo - 1]) if lo > 0 else _HUGE
    return v + _best_gain(room, r_add, r_drop)


def _surrogate_bound(sur: Surrogate, w: np.ndarray, v: np.ndarray, c: np.ndarray,
                     cap: int, lo: int, hi: int) -> np.ndarray | None:
    """The same bound in the surrogate space (capacity plus lam per item slot)."""
    r_add, r_drop = float(sur.add_max[hi]), min(float(sur.drop_min[lo]), _HUGE)
    if r_add > r_drop:  # swaps could gain: the linear bound would not be valid
        return None
    # [bound] room' = (cap - W) + lam * (k - c), valued at the best ratio left
    room = (cap - w).astype(np.float64) + sur.lam * (sur.k - c)
    return v + _best_gain(room, r_add, r_drop)


def _best_gain(room: np.ndarray, r_add: float, r_drop: float) -> np.ndarray:
    """room * r_add when room >= 0, room * r_drop when room < 0 (r_add <= r_drop)."""
    # [bound] fill spare room at ratio <= r_add, or free the excess at ratio >= r_drop
    with np.errstate(over="ignore"):  # room * _HUGE overflows to +-inf: still right
        return np.minimum(room * r_add, room * r_drop)
