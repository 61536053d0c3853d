"""Sliding-window DP with Hirschberg's divide and conquer, in O(W) memory.

Method of J. Maczan (2026), "Memory-Efficient Activation Checkpointing with Sliding
Window and Hirschberg's Algorithm for 0/1 Knapsack Solving in PyTorch", after
Hirschberg (1975): two DP rows per half, best capacity split, explicit stack.
"""

from __future__ import annotations

from functools import cache

import numpy as np

_CHUNK = 1 << 15  # cells per vectorised step: the scratch buffer stays in cache
LEAF = 8  # segments this small are solved by enumerating their subsets


def hirschberg_select(q: np.ndarray, v: np.ndarray, cap: int, leaf: int = LEAF) -> np.ndarray:
    """Indices of an optimal selection for integer weights `q` >= 1 and runtimes `v` > 0.

    Memory: two float64 rows of min(cap, sum(q)) + 1 cells, a fixed scratch
    buffer and a stack of O(log n) frames.
    """
    width = int(min(cap, int(q.sum()))) + 1
    rows: tuple[np.ndarray, np.ndarray] | None = None  # allocated on the first split
    scratch = np.empty(_CHUNK)
    chosen: list[np.ndarray] = []
    # Items ordered by weight: light halves have small sums, so short rows.
    stack = [(np.argsort(q, kind="stable"), int(cap))]
    while stack:
        items, c = stack.pop()
        items = items[q[items] <= c]
        if items.size == 0:
            continue
        if int(q[items].sum()) <= c:
            chosen.append(items)
            continue
        if items.size <= leaf:
            chosen.append(items[_best_subset(q[items], v[items], c)])
            continue
        left, right = items[: items.size // 2], items[items.size // 2 :]
        if rows is None:
            rows = (np.empty(width), np.empty(width))
        lim_l = profile(q[left], v[left], c, rows[0], scratch)
        lim_r = profile(q[right], v[right], c, rows[1], scratch)
        split = best_split(rows[0], lim_l, rows[1], lim_r, c)
        # [split] left gets `split`, right gets exactly what is left: c - split
        stack.append((right, c - split))
        stack.append((left, split))
    return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)


def profile(q: np.ndarray, v: np.ndarray, cap: int, row: np.ndarray, scratch: np.ndarray) -> int:
    """Fill row[c] = best runtime of a subset of the items with weight <= c.

    Only cells up to lim = min(cap, sum(q)) are written and lim is returned: beyond
    the items' total weight the row is constant (all items fit).
    """
    row[0] = 0.0
    lim, total = 0, 0.0
    for qj, vj in zip(q.tolist(), v.tolist()):
        new_lim = min(cap, lim + qj)
        row[lim + 1 : new_lim + 1] = total  # capacities that held every earlier item
        _add_item(row, qj, vj, new_lim, scratch)
        lim, total = new_lim, total + vj
    return lim


def _add_item(row: np.ndarray, qj: int, vj: float, top: int, scratch: np.ndarray) -> None:
    """In-place row update for one item, top-down in cache-sized chunks."""
    hi = top + 1
    while hi > qj:
        lo = max(qj, hi - _CHUNK)
        tmp = scratch[: hi - lo]
        # [recurrence] row[c] = max(row[c], row[c - q_j] + v_j), c from the top down
        np.add(row[lo - qj : hi - qj], vj, out=tmp)
        np.maximum(row[lo:hi], tmp, out=row[lo:hi])
        hi = lo


def best_split(left: np.ndarray, lim_l: int, right: np.ndarray, lim_r: int, cap: int) -> int:
    """argmax over s of left[s] + right[cap - s]; rows are constant past their lim."""
    lo, hi = max(0, cap - lim_r), min(cap, lim_l)
    best_val, best_at = -np.inf, lo
    for start in range(lo, hi + 1, _CHUNK):
        stop = min(hi + 1, start + _CHUNK)
        # [split] value(s) = left[s] + right[cap - s] for s in [start, stop)
        vals = left[start:stop] + right[cap - stop + 1 : cap - start + 1][::-1]
        i = int(np.argmax(vals))
        if vals[i] > best_val:
            best_val, best_at = float(vals[i]), start + i
    return best_at


@cache
def _subset_masks(k: int) -> np.ndarray:
    codes = np.arange(1 << k)[:, None] >> np.arange(k)[None, :]
    return (codes & 1).astype(bool)


def _best_subset(q: np.ndarray, v: np.ndarray, cap: int) -> np.ndarray:
    """Enumerate all subsets of a few items; return the best feasible one's indices."""
    masks = _subset_masks(q.size)
    weight = masks.astype(np.int64) @ q
    value = np.where(weight <= cap, masks.astype(np.float64) @ v, -np.inf)
    return np.flatnonzero(masks[int(np.argmax(value))])
