"""Lower bounds on the recompute of a chain prefix that must leave at most h bytes resident.

Used by `chain_planner` to prune partial plans that cannot finish within a cost, and to
prove how far a plan found under a time limit can be from the optimum.

[constraint] The blocks before p leave W_p bytes resident when all are kept. A segment
[a, b] leaves its boundary x_a instead (less o_a when block a - 1 is kept and saved
it), so it frees at most saved_a + ... + saved_b - x_a + o_a, at a cost of its blocks'
recompute less the last block's skipped tail, plus the segment overhead; a block
checkpointed alone with op option j (`op_options`) also keeps keep_j and costs value_j
less. A kept block after a segment only adds bytes (its shared storages): ignored.

`ChainBound`, the planner's bound, is the Lagrangian dual of "free at least W_p - h
bytes at the least cost": for a price lam per byte freed, the least cost - lam * freed
over all plans of every prefix is one two-state DP over the blocks (inside a segment or
not), so each segment pays for its boundary once. The best line over a grid of prices
is a convex lower bound in the bytes to free (the convex envelope of the prefix plans'
(freed, cost) points at those prices; Fisher, "The Lagrangian relaxation method for
solving integer programming problems", Management Science 27, 1981), +inf beyond the
most any prefix plan frees. `PrefixBound` is the weaker linear relaxation that treats
blocks as independent items freeing up to saved_i each. Values are float64 and
compared with a margin (`slack`).
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
    """`bound(p, h)`: a lower bound on the recompute of blocks 0..p-1 leaving at most h resident,
    blocks taken as independent items (the linear relaxation of the multiple-choice knapsack).

    Per block, the lower convex hull of its (bytes freed, cost) points, from (0, 0) (whole:
    saved_i at rc_i - tail_i; op option j: saved_i - keep_ij at value_ij less), taken in
    increasing cost per byte over all blocks before p; falls in cost are always taken.

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


class ChainBound:
    """`bound(p, h)`: a lower bound on the recompute of blocks 0..p-1 leaving at most h resident,
    from the Lagrangian dual over plans with segments (see the module docstring).

    saved, x, o: per block, its saved bytes, its input (a segment's boundary) and the part of
    it the block before saves (o may have one more entry, ignored); rc, tails: its recompute
    and skipped tail in solver units; seg: the overhead of one segment; chains: whether the
    block may continue a segment from the block before; options: per block, (keep_bytes,
    value) of its op options (none for block-level plans). At most `max_prices` prices.
    """

    def __init__(
        self,
        saved: np.ndarray,
        x: np.ndarray,
        o: np.ndarray,
        rc: np.ndarray,
        tails: np.ndarray,
        seg: float,
        chains: np.ndarray,
        options: Sequence[Sequence[tuple[float, float]]] | None = None,
        max_prices: int = 1024,
    ):
        self.n = n = saved.shape[0]
        f64 = np.float64
        self.w_in = w_in = saved.astype(f64)  # freed by a block inside a segment
        self.w_first = w_first = w_in - x.astype(f64) + o[:n].astype(f64)  # by the first block of a segment
        self.c, self.t, self.seg = rc.astype(f64), tails.astype(f64), float(seg)
        self.chains, self.options, self.max_prices = chains, options, max_prices
        self.W = np.concatenate(([0.0], np.cumsum(w_in)))
        self.scale = 1.0 + float(np.abs(self.c).sum()) + abs(self.seg) * n
        # prices stay below 100 * scale / bytes, so every term below 100 * scale: n sums of
        # them round by less than n * 2**-52 * 100 * scale
        self.slack = (1e-9 + 1e-13 * n) * self.scale
        # the most bytes any plan of blocks 0..i - 1 frees (f_keep, f_seg: its last block not in / in a segment)
        self.most = most = np.zeros(n + 1)
        f_keep, f_seg = 0.0, -np.inf
        for i in range(n):
            f_closed = max(f_keep, f_seg)
            f_seg = max(f_closed + w_first[i], f_seg + w_in[i] if chains[i] else -np.inf)
            alone = [w_first[i] - k for k, _ in options[i]] if options is not None else ()
            f_keep = f_closed + max([0.0, *alone])
            most[i + 1] = max(f_keep, f_seg)
        self.g: np.ndarray | None = None  # the prices' table, on the first `bound` (`_prices_table`)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _prices_table(self) -> np.ndarray:
        """g[i, k]: the least cost - lam_k * freed over the plans of blocks 0..i - 1."""
        n, w_in, w_first, c, t, seg, options = self.n, self.w_in, self.w_first, self.c, self.t, self.seg, self.options
        k_max = max(2, min(self.max_prices, (1 << 22) // (n + 1)))
        self.lam = lam = _prices(w_in, w_first, c, t, seg, options, self.scale, k_max)
        # [recurrence] per price: G_keep, G_seg = least cost - lam * freed of blocks 0..i with
        # block i not in / in a segment block i + 1 may continue
        g = np.empty((n + 1, lam.shape[0]))
        g[0] = 0.0
        g_keep, g_seg = np.zeros(lam.shape[0]), np.full(lam.shape[0], np.inf)
        for i in range(n):
            # the element before i ends there: a segment pays its overhead and skips its tail
            closed = np.minimum(g_keep, g_seg - (t[i - 1] - seg if i else 0.0))
            new_seg = closed + (c[i] - lam * w_first[i])
            if self.chains[i]:
                np.minimum(new_seg, g_seg + (c[i] - lam * w_in[i]), out=new_seg)
            g_keep = closed
            if options is not None and len(options[i]):
                k, v = (np.array(z, dtype=np.float64) for z in zip(*options[i]))
                alone = closed[None, :] + ((c[i] - t[i] + seg - v)[:, None] - lam[None, :] * (w_first[i] - k)[:, None])
                g_keep = np.minimum(closed, alone.min(axis=0))
            g_seg = new_seg
            # a prefix may end inside a segment (no overhead, no tail: both fall to what
            # follows) or with it (both paid): the lesser serves either
            g[i + 1] = np.minimum(np.minimum(g_keep, g_seg), g_seg - (t[i] - seg))
        self.g = g
        return g

    def reaches(self, p: int, h: float) -> bool:
        """Whether some plan of blocks 0..p-1 leaves at most `h` resident (as this bound counts bytes)."""
        return bool(self.W[p] - h <= self.most[p])

    def _table(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """The vertices of max over prices of (g_p(lam) + lam * r), r the bytes to free."""
        tab = self._cache.get(p)
        if tab is None:
            if len(self._cache) > 2:  # the DP walks p downwards and asks for p and p + 1
                self._cache = {k: t for k, t in self._cache.items() if k <= p + 1}
            g = (self._prices_table() if self.g is None else self.g)[p]
            lam, most = self.lam, float(self.most[p])
            # g is concave in lam (a least of lines), so line k is the best between the
            # crossings with its neighbours; the crossings rise (up to rounding: made to)
            r = (g[:-1] - g[1:]) / (lam[1:] - lam[:-1])
            np.minimum(np.maximum.accumulate(r), most, out=r)
            # each vertex on the lesser of its two lines: both ends of every chord then lie
            # under the line between them, so the interpolation stays a bound whatever the rounding
            v = np.minimum(g[:-1] + lam[:-1] * r, g[1:] + lam[1:] * r)
            tab = self._cache[p] = (np.append(r, most), np.append(v, g[-1] + lam[-1] * most))
        return tab

    def bound(self, p: int, h: np.ndarray) -> np.ndarray:
        """Lower bound on the recompute of blocks 0..p-1 leaving at most `h` resident."""
        xs, vs = self._table(p)
        r = self.W[p] - h
        return np.where(r <= self.most[p], np.interp(r, xs, vs), np.inf)

    def total(self, h: int) -> float:
        n = self.W.shape[0] - 1
        return float(self.bound(n, np.array([float(h)]))[0])


def chain_bound(a) -> ChainBound:
    """The `ChainBound` of the planner's columns `a` (a `chain_arrays.ChainArrays`)."""
    n = a.n
    chains = np.zeros(n, dtype=bool)
    chains[1:] = a.next_break[:-1] != np.arange(1, n)  # block i may continue a segment from i - 1
    seg = float(a.K[1] - a.P[1] + a.tails[0]) if n else 0.0  # K[q] = P[q] - tail[q - 1] + overhead
    opts = [list(zip(k.tolist(), v.tolist())) for k, v in zip(a.opt_k, a.opt_v)] if a.opt_k else None
    return ChainBound(a.saved, a.x, a.o, a.rc, a.tails, seg, chains, opts)


def _prices(w_in, w_first, c, t, seg, options, scale, k_max) -> np.ndarray:
    """The grid of prices per byte: 0 and the cost per byte of each block inside a segment,
    alone and with each op option (where the envelope bends), at most `k_max` of them
    (evenly by rank), and none so high that float64 rounding could exceed the margin."""
    parts = [np.zeros(1)]
    for w, cost in ((w_in, c), (w_first, c - t + seg)):
        ok = w > 0
        parts.append(cost[ok] / w[ok])
    per_option = [((c[i] - t[i] + seg - v), w_first[i] - k) for i, opts in enumerate(options or ()) for k, v in opts]
    parts.append(np.array([cost / w for cost, w in per_option if w > 0], dtype=np.float64))
    lam = np.concatenate(parts)
    total_bytes = max(1.0, float(np.abs(w_in).sum()))
    lam = np.unique(lam[(lam >= 0) & (lam <= 1e2 * scale / total_bytes)])
    if lam.shape[0] > k_max:
        lam = np.unique(lam[np.linspace(0, lam.shape[0] - 1, k_max).round().astype(np.int64)])
    return lam
