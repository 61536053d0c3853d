"""The least-recompute multi-level plan under a byte budget (rotor's recurrence, over
heterogeneous blocks and the memory model of `memory_model` / `nested_model`).

Memory is counted in whole slots of `q` bytes (`q` = the budget above the base bytes
divided by `slots`, at least 1 byte): every need and every resident size is rounded up,
every relief down, so a plan that fits in slots fits in bytes. With `q` = 1 (budgets of
at most `slots` bytes above the base, as in the brute-force tests) the planner is exact
over every nested plan of depth <= `max_depth`.

Tables, for a memory level m (slots available above what is resident):
  S_d(a, b)[m]  least cost of segment [a, b] with inner plans of depth < d whose
                backward fits in m (`nested_model.nested_backward`); S_1 is the plain segment;
  D(p, k)[m]    inside the recompute of a parent ending at b: least cost of its elements
                from block p on, k telling whether the element before p is a child;
  T(p, k)[m]    the same at the top level, over the whole chain (forward terms included).
Each is a min over the first element (a block that saves, or a segment [p, e] with its
own table), O(n^3) vector operations per depth. The scratch of a recompute's forward
(max over its saving blocks) is handled exactly by solving once per distinct value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.element_arrays import element_arrays
from lightning_ckpt.planning.memory_model import (
    base_bytes,
    end_need,
    end_relief,
    optimizer_need,
    segment_elements,
    step_terms,
)
from lightning_ckpt.planning.peak_terms import (
    child_forward_bytes,
    kept_backward_bytes,
    recompute_end_bytes,
    recompute_scratch_bytes,
    segment_activations_bytes,
    segment_inflight_bytes,
)
from lightning_ckpt.planning.recompute_cost import (
    block_recompute,
    metric_rates,
    segment_overhead,
    skipped_tail,
)

INF = np.inf
# O(n^3) vector operations per level; at 48 blocks and 2 levels 0.4-0.55 s with 1024 slots, 0.2 s with 256
# (one CPU thread of this project's machine)
NESTED_MAX_BLOCKS = 96


@dataclass(frozen=True)
class NestedSolution:
    segments: tuple[tuple[int, int], ...]
    inner: tuple[tuple[int, int], ...]
    cost: float  # in the metric's units (`recompute_cost.recompute_cost`)
    slot_bytes: int  # the slot size q the search counted memory in


class _Tables:
    def __init__(self, cost: StepCost, budget_bytes: int, metric: str, slots: int) -> None:
        n = cost.n_blocks
        blocks = cost.blocks
        rates = metric_rates(cost, metric)
        terms = step_terms(cost)
        self.n = n
        self.base = base_bytes(cost)
        room = int(budget_bytes) - self.base
        self.q = q = max(1, -(-room // slots)) if room > 0 else 1
        self.M = room // q if room >= 0 else -1
        self.m = np.arange(self.M + 1) if self.M >= 0 else np.zeros(0, dtype=np.int64)
        a = element_arrays(cost)

        def up(v):
            return -(-np.asarray(v, dtype=np.int64) // q)

        self.Tk = up(kept_backward_bytes(a.blocks, a.G, a.grads_kept))  # a saving block's backward
        self.Rk = up(a.saved)
        self.Rx = up(a.x)
        self.SH = up(a.sh[:n])
        self.O = np.asarray(a.o[:n], dtype=np.int64) // q
        self.X0 = up(segment_activations_bytes(a.blocks, 0))
        self.keep_need = up(a.keep_need - self.base)
        self.blocks, self.G = blocks, a.G  # for the terms of a parent ending at b
        self.ft = recompute_scratch_bytes(a.blocks)
        self.up = up
        self.next_break = np.full(n, n, dtype=np.int64)  # first block k > p that does not chain from k - 1
        nb = n
        self.held = np.array([bool(b.unreplayable) for b in blocks], dtype=bool)  # must stay kept
        for k in range(n - 1, -1, -1):
            self.next_break[k] = nb
            # [constraint] a block that must stay kept ends every segment before it (and after it)
            if not blocks[k].chains_from_previous or self.held[k]:
                nb = k
            if k + 1 < n and self.held[k]:
                self.next_break[k] = min(int(self.next_break[k]), k + 1)
        self.rc = np.array([block_recompute(b, metric, rates) for b in blocks], dtype=np.float64)
        self.tail = np.array([skipped_tail(b, metric, rates) for b in blocks], dtype=np.float64)
        self.ovh = float(segment_overhead(metric, rates))
        self.P = np.concatenate(([0.0], np.cumsum(self.rc)))
        # plain segments: forward above the base (last step's gradients included), backward
        self.fwd = np.full((n, n), -1, dtype=np.int64)
        self.rfwd = np.zeros((n, n), dtype=np.int64)  # a segment's in-flight forward inside a recompute
        self.bwd = np.full((n, n), -1, dtype=np.int64)
        for p in range(n):
            for el in segment_elements(cost, p, terms):
                self.fwd[p, el.last] = el.forward_bytes - self.base
                self.bwd[p, el.last] = el.backward_bytes - self.base
                self.rfwd[p, el.last] = segment_inflight_bytes(blocks, p, el.last)
        self.fwd_grads = terms.forward_grad_bytes
        self.end = [up(end_need(cost) - self.base - end_relief(cost, kept)) for kept in (True, False)]
        self.phis = sorted({0, *(int(v) for v in self.ft)})
        self.S: dict[int, np.ndarray] = {}  # depth -> (n, n, M + 1) costs (1: plain segments)
        self.choice: dict[int, np.ndarray] = {}  # depth -> (n, n, M + 1): -2 plain, -1 first block saves, e child
        self.phi_at: dict[int, np.ndarray] = {}

    # -- vector helpers (memory along the last axis)
    def shift(self, v: np.ndarray, r: int) -> np.ndarray:
        """w[..., m] = v[..., m - r] (inf below 0, v[..., M] above M)."""
        r = int(r)
        if r == 0:
            return v
        w = np.full(v.shape, INF)
        if r > 0:
            if r <= self.M:
                w[..., r:] = v[..., : self.M + 1 - r]
            return w
        r = min(-r, self.M + 1)
        w[..., : self.M + 1 - r] = v[..., r:]
        w[..., self.M + 1 - r :] = v[..., self.M : self.M + 1]
        return w

    def below(self, cand: np.ndarray, need) -> np.ndarray:
        """cand with inf where m < need (need: a scalar, or one per row)."""
        need = np.asarray(need)
        if need.ndim == 0:
            cand[..., : max(0, min(self.M + 1, int(need)))] = INF
        else:
            cand[self.m[None, :] < need[:, None]] = INF
        return cand

    def child_forward(self, p: int, es: np.ndarray, b: int) -> np.ndarray:
        """The forward of children [p, e] (e in `es`) inside the recompute of a parent ending at b."""
        return child_forward_bytes(self.rfwd[p, es], self.blocks[b], self.G[b])

    def plain_rows(self, a: int, es: np.ndarray) -> np.ndarray:
        c = self.P[es + 1] - self.P[a] - self.tail[es] + self.ovh
        return np.where(self.m[None, :] >= self.up(self.bwd[a, es])[:, None], c[:, None], INF)

    def child_rows(self, d: int, a: int, e0: int, e1: int) -> np.ndarray:
        """Segments [a, e] for e in [e0, e1] with inner plans of depth < d + 1, one row each."""
        return self.S[max(d, 1)][a, e0 : e1 + 1]

    def last_chained(self, a: int, b: int) -> int:
        return min(b, int(self.next_break[a]) - 1)

    @staticmethod
    def pick(rows: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row minimum per memory level and its label (the first row of equal ones)."""
        i = np.argmin(rows, axis=0)
        return rows[i, np.arange(rows.shape[1])], labels[i]

    # -- inside the recompute of a parent ending at b, children of depth < d, saving blocks' scratch <= phi
    def inner_table(self, d: int, b: int, phi: int, lo: int, record: bool = False):
        M1 = self.M + 1
        D = np.full((2, b + 2, M1), INF)  # D[k, p]: k = 1 when the element before p is a child
        D[:, b + 1] = np.where(self.m >= self.up(recompute_end_bytes(self.blocks[b], self.G[b], 0, phi)), 0.0, INF)
        picks = np.full((2, b + 2, M1), -3, dtype=np.int32) if record else None
        for p in range(b, lo - 1, -1):
            e1 = self.last_chained(p, b)
            es = np.arange(p, e1 + 1)
            kids = self.child_rows(d - 1, p, p, e1)
            add = np.where(es < b, self.P[es + 1] - self.P[p], 0.0)[:, None]
            cf = np.where(es < b, self.up(self.child_forward(p, es, b)), 0)
            labels = np.concatenate(([-1], es))
            same = self.SH[p] == 0 and self.O[p] == 0
            for k in (0, 1):
                if k == 1 and same:
                    D[1, p] = D[0, p]
                    if record:
                        picks[1, p] = picks[0, p]
                    continue
                s_keep = int(self.SH[p]) if k else 0
                keep = self.shift(D[0, p + 1], s_keep + self.Rk[p]) + (self.rc[p] - (self.tail[b] if p == b else 0.0))
                if self.ft[p] > phi:
                    keep = np.full(M1, INF)
                self.below(keep, self.Tk[p] + s_keep)
                s = -int(self.O[p]) if k == 0 else 0
                cand = self.shift(kids, s) + self.shift(D[1, p + 1 : e1 + 2], s + self.Rx[p]) + add
                self.below(cand, cf + s)
                D[k, p], lab = self.pick(np.vstack((keep[None, :], cand)), labels)
                if record:
                    picks[k, p] = lab
        return D, picks

    def starts(self, d: int, a: int, b: int, D, phi: int) -> tuple[np.ndarray, np.ndarray]:
        """Best first element of segment [a, b] (a < b) given the table D of the rest."""
        keep = self.shift(D[0, a + 1], self.X0[a] + self.Rk[a]) + self.rc[a]
        if self.ft[a] > phi:
            keep = np.full(self.M + 1, INF)
        self.below(keep, self.X0[a] + self.Tk[a])
        e1 = self.last_chained(a, b - 1)
        es = np.arange(a, e1 + 1)
        cand = self.child_rows(d - 1, a, a, e1) + self.shift(D[1, a + 1 : e1 + 2], self.Rx[a])
        cand += (self.P[es + 1] - self.P[a])[:, None]
        self.below(cand, self.up(self.child_forward(a, es, b)))
        val, lab = self.pick(np.vstack((keep[None, :], cand)), np.concatenate(([-1], es)))
        return val + self.ovh, lab

    def build(self, max_depth: int) -> None:
        n = self.n
        self.S[1] = np.stack([self.plain_rows(a, np.arange(n)) for a in range(n)])
        if self.held.any():  # [constraint] no segment starts at a block that must stay kept
            self.S[1][self.held] = INF
        for d in range(2, max_depth + 1):
            S = self.S[1].copy()
            C = np.full(S.shape, -2, dtype=np.int32)
            F = np.zeros(S.shape, dtype=np.int32)
            for b in range(n):
                lo = b
                while lo > 0 and self.chains(lo - 1, b):
                    lo -= 1
                if lo == b:
                    continue
                for fi, phi in enumerate(self.phis):
                    D, _ = self.inner_table(d, b, phi, lo + 1)
                    for a in range(lo, b):
                        val, pick = self.starts(d, a, b, D, phi)
                        better = val < S[a, b]
                        S[a, b] = np.where(better, val, S[a, b])
                        C[a, b] = np.where(better, pick, C[a, b])
                        F[a, b] = np.where(better, fi, F[a, b])
            self.S[d], self.choice[d], self.phi_at[d] = S, C, F

    def chains(self, a: int, b: int) -> bool:
        return b < self.next_break[a]

    # -- the top level
    def top(self, depth: int):
        n, M1 = self.n, self.M + 1
        T = np.full((2, n + 1, M1), INF)
        for k in (0, 1):
            T[k, n] = np.where(self.m >= self.end[k], 0.0, INF)
        picks = np.full((2, n, M1), -3, dtype=np.int32)
        for p in range(n - 1, -1, -1):
            e1 = self.last_chained(p, n - 1)
            es = np.arange(p, e1 + 1)
            segs = self.child_rows(depth, p, p, e1)
            labels = np.concatenate(([-1], es))
            for k in (0, 1):
                s_keep = int(self.SH[p]) if k else 0
                keep = self.below(self.shift(T[0, p + 1], s_keep + self.Rk[p]).copy(), self.keep_need[p] + s_keep)
                s = -int(self.O[p]) if k == 0 else 0
                cand = self.shift(segs, s) + self.shift(T[1, p + 1 : e1 + 2], s + self.Rx[p])
                self.below(cand, self.up(self.fwd[p, es]) + s)
                T[k, p], picks[k, p] = self.pick(np.vstack((keep[None, :], cand)), labels)
        return T, picks

    # -- reading a plan back
    def expand(self, d: int, a: int, b: int, m: int, inner: list) -> None:
        """Append the inner segments of segment [a, b] at depth <= d chosen at memory m."""
        if d <= 1 or a == b or self.choice[d][a, b, m] == -2:
            return
        first = int(self.choice[d][a, b, m])
        phi = self.phis[int(self.phi_at[d][a, b, m])]
        _, ch = self.inner_table(d, b, phi, a + 1, record=True)
        if first == -1:
            m, p, k = m - int(self.X0[a] + self.Rk[a]), a + 1, 0
        else:
            inner.append((a, first))
            self.expand(d - 1, a, first, m, inner)
            m, p, k = m - int(self.Rx[a]), first + 1, 1
        while p <= b:
            e = int(ch[k, p, min(m, self.M)])
            if e == -1:
                m -= int(self.SH[p]) if k else 0
                m, p, k = m - int(self.Rk[p]), p + 1, 0
            else:
                s = -int(self.O[p]) if k == 0 else 0
                inner.append((p, e))
                self.expand(d - 1, p, e, min(m - s, self.M), inner)
                m, p, k = m - s - int(self.Rx[p]), e + 1, 1

    def read_plan(self, picks: np.ndarray, m: int, depth: int) -> tuple[tuple, tuple]:
        """The top-level and inner segments of the plan chosen at memory level `m`."""
        segments, inner = [], []
        p, k = 0, 0
        while p < self.n:
            e = int(picks[k, p, m])
            if e == -1:
                m -= (int(self.SH[p]) if k else 0) + int(self.Rk[p])
                p, k = p + 1, 0
            else:
                s = -int(self.O[p]) if k == 0 else 0
                segments.append((p, e))
                self.expand(depth, p, e, min(m - s, self.M), inner)
                m, p, k = min(m - s - int(self.Rx[p]), self.M), e + 1, 1
        return tuple(segments), tuple(sorted(inner))


def least_nested_recompute(cost: StepCost, metric: str) -> tuple[float, float] | None:
    """(a lower bound on the recompute of every plan with an inner segment, the scale of its terms), or None
    when a segment may cost less than 0 (or a cost is not finite): then there is no such bound here.

    [bound] With every plain segment costing c(a, b) = P[b + 1] - P[a] - tail[b] + overhead >= 0, a segment
    [a, b] with children costs at least c(a, b) plus min(overhead, the least c): its recompute is c(a, b)
    and each child's at least that child's c, or, when its last element is a child [e, b], the blocks
    before e, the overhead and that child, which add up to c(a, b) + overhead (`nested_model.nested_segment_cost`,
    by induction on the depth). A plan with an inner segment has such a segment of two blocks or more, and
    every other segment costs at least 0."""
    rates = metric_rates(cost, metric)
    rc = [block_recompute(b, metric, rates) for b in cost.blocks]
    tails = [skipped_tail(b, metric, rates) for b in cost.blocks]
    ovh = segment_overhead(metric, rates)
    n = len(rc)
    if n < 2 or ovh < 0:
        return None
    least, least_long = math.inf, math.inf
    for a in range(n):
        run = 0
        for b in range(a, n):
            run += rc[b]
            c = run - tails[b] + ovh
            least = min(least, c)
            if b > a:
                least_long = min(least_long, c)
    scale = sum(map(abs, rc)) + sum(map(abs, tails)) + n * ovh
    if not (least >= 0 and math.isfinite(least_long) and math.isfinite(scale)):
        return None
    return least_long + min(ovh, least), scale


def solve_nested(
    cost: StepCost, budget_bytes: int, metric: str = "flops", max_depth: int = 3, slots: int = 1024
) -> NestedSolution | None:
    """The least-recompute plan with inner segments up to `max_depth` levels deep (1: plain
    segments only) whose predicted peak fits `budget_bytes`, or None when none fits at
    this slot size."""
    return solve_nested_levels(cost, [budget_bytes], metric, max_depth, slots)[0]


def solve_nested_levels(
    cost: StepCost, budgets: Sequence[int], metric: str = "flops", max_depth: int = 3, slots: int = 1024
) -> list[NestedSolution | None]:
    """`solve_nested` at every budget of `budgets` from one set of tables.

    The tables are built once for the largest budget: every table holds the least cost at
    every memory level from 0 to `slots` slots, so the plan for a smaller budget is read back
    at its own level, (budget - base) // q slots, with the slot size q of the largest one
    (a smaller budget is counted in fewer, equally fine slots). None where nothing fits."""
    if max_depth < 1:
        raise ValueError(f"max_depth={max_depth} must be >= 1 (1 plans without inner segments).")
    out: list[NestedSolution | None] = [None] * len(budgets)
    if not budgets:
        return out
    t = _Tables(cost, max(budgets), metric, slots)
    if t.M < 0 or t.n == 0:
        return out
    t.build(max_depth)
    T, picks = t.top(max_depth)
    need = optimizer_need(cost)
    for i, budget in enumerate(budgets):
        room = int(budget) - t.base
        if room < 0 or need > budget:
            continue
        m0 = min(room // t.q, t.M)
        if np.isfinite(T[0, 0, m0]):
            segments, inner = t.read_plan(picks, m0, max_depth)
            out[i] = NestedSolution(segments, inner, float(T[0, 0, m0]), t.q)
    return out
