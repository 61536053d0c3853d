"""Lower bounds on the recompute of a chain prefix that must leave at most h bytes resident.

Used by `chain_planner` to prune partial plans that cannot finish within the best cost
found so far.

[constraint] The blocks before p leave W_p bytes resident when all are kept. A block
checkpointed whole leaves 0 or its input instead of its saved bytes, so it frees at
most saved_i and costs at least rc_i - tail_i; checkpointed with op option j
(`op_options`) it frees at most saved_i - keep_ij at a cost of at least
rc_i - tail_i - value_ij. Per block, the lower convex hull of these (bytes freed,
cost) points, from (0, 0), is a convex under-estimate of its least cost for any bytes
freed; its segments, taken in increasing cost per byte over all blocks before p
(the linear relaxation of the multiple-choice knapsack "free at least W_p - h bytes
at the least cost"), give a lower bound on every prefix plan's recompute: a convex
piecewise linear function of the bytes to free, evaluated with `np.interp`, +inf
when even the largest frees cannot reach. Hull segments of negative cost are always
taken. Values are float64 and compared with a margin (`slack`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of `points` (x ascending), of the least y at each x."""
    best: dict[float, float] = {}
    for x, y in points:
        if x not in best or y < best[x]:
            best[x] = y
    hull: list[tuple[float, float]] = []
    for x, y in sorted(best.items()):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (x - x1) >= (y - y1) * (x2 - x1):  # hull[-1] on or above the chord
                hull.pop()
            else:
                break
        hull.append((x, y))
    return hull


class PrefixBound:
    """`bound(p, h)`: a lower bound on the recompute of blocks 0..p-1 leaving at most h resident.

    saved, cost: per block, its saved bytes and its whole recompute less its skipped tail.
    W: prefix sums of `saved` (n + 1). options: per block, (keep_bytes, value) pairs of
    its op options, in the same cost units (none for block-level plans).
    """

    def __init__(
        self,
        saved: np.ndarray,
        cost: np.ndarray,
        W: np.ndarray,
        options: Sequence[Sequence[tuple[float, float]]] | None = None,
    ):
        n = saved.shape[0]
        self.W = W.astype(np.float64)
        blk, dw, dc = [], [], []
        neg_w = np.zeros(n)
        neg_c = np.zeros(n)
        for i in range(n):
            w, c = float(saved[i]), float(cost[i])
            pts = [(0.0, 0.0), (w, c)]
            if options is not None:
                # an option that holds more than the block saves frees nothing (never less:
                # freeing more only lowers the bound, which stays a bound)
                pts += [(max(0.0, w - float(k)), c - float(v)) for k, v in options[i]]
            hull = _lower_hull(pts)
            base = hull[0][1]  # the least cost of freeing nothing (<= 0: (0, 0) is a point)
            neg_c[i] += base
            px, py = 0.0, base
            for x, y in hull:
                if x <= px:
                    continue
                ddw, ddc = x - px, y - py
                if ddc < 0:  # [bound] a fall in cost is always taken
                    neg_w[i] += ddw
                    neg_c[i] += ddc
                else:
                    blk.append(i)
                    dw.append(ddw)
                    dc.append(ddc)
                px, py = x, y
        self.neg_w = np.concatenate(([0.0], np.cumsum(neg_w)))
        self.neg_c = np.concatenate(([0.0], np.cumsum(neg_c)))
        self.blk = np.array(blk, dtype=np.int64)
        self.w = np.array(dw, dtype=np.float64)
        self.c = np.array(dc, dtype=np.float64)
        ratio = self.c / self.w if self.w.shape[0] else self.w
        self.order = np.argsort(ratio, kind="stable")
        self.slack = 1e-9 * (1.0 + float(np.abs(cost.astype(np.float64)).sum()))
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _table(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        tab = self._cache.get(p)
        if tab is None:
            if len(self._cache) > 2:  # the DP walks p downwards and asks for p and p + 1
                self._cache = {k: t for k, t in self._cache.items() if k <= p + 1}
            sel = self.order[self.blk[self.order] < p]
            xs = np.empty(sel.shape[0] + 1)
            ys = np.empty(sel.shape[0] + 1)
            xs[0] = ys[0] = 0.0
            np.cumsum(self.w[sel], out=xs[1:])
            np.cumsum(self.c[sel], out=ys[1:])
            tab = self._cache[p] = (xs, ys)
        return tab

    def bound(self, p: int, h: np.ndarray) -> np.ndarray:
        """Lower bound on the recompute of blocks 0..p-1 leaving at most `h` resident."""
        xs, ys = self._table(p)
        r = (self.W[p] - self.neg_w[p]) - h
        return np.interp(r, xs, ys, left=0.0, right=np.inf) + self.neg_c[p]

    def total(self, h: int) -> float:
        n = self.W.shape[0] - 1
        return float(self.bound(n, np.array([float(h)]))[0])
