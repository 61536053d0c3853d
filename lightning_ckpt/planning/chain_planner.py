"""Exact, fast chain planner: the `optimal` policy for the memory model of `memory_model`.

The problem: a plan is a sequence of elements ("keep block p", "checkpoint segment
[p, b]") whose needs, resident bytes and shifts are `memory_model`'s element form
(`element_arrays`, `segment_need_rows`; docs/design.md); its peak is
max(opt_need, R_n + end_need - relief, max_e (R_e + need_e + shift_e)). `optimal`
asks for the least recompute sum_e cost_e with peak <= budget, then the lowest peak.

The algorithm (backward Pareto DP over suffixes)
------------------------------------------------
[recurrence] Read a plan from the back. The suffix starting at block p has a
*demand* D: the peak it causes on top of a prefix that leaves R resident is R + D.
For the last position D = end_need, and an element e from p to q prepends as

    D_p = max(need_e, res_e + D_q),   C_p = cost_e + C_q

(the next element's shift, which depends only on whether e is kept, applied as e is
prepended). D_p is nondecreasing in D_q and C_p in C_q, so a suffix (D, C) that
another from p with the same first-element kind beats or equals on both can be
dropped: the Pareto frontier F_p of (D, C) is exact. At position 0 nothing precedes, so a plan's peak is max(opt_need, D_0): F_0
holds the lowest peak for every cost, and the answer (least cost with peak <=
budget, then the lowest peak) is read off it, with no bisection over budgets.
States with D > budget are dropped at once (D only grows towards the front).

Speed: a pool of segment continuations instead of every (start, end) pair
--------------------------------------------------------------------------
A segment [p, q-1] continued by a suffix state s of F_q yields

    (max(need(p, q-1), x_p + D_s),  K_q + C_s - P_p)

with x_p the input bytes of block p (the segment's resident boundary), P the
prefix sums of block recompute and K_q = P_q - tail_{q-1}. Apart from need(p, q-1)
and the shifts x_p, P_p (common to all candidates of p), an option (q, D_s,
Ct = K_q + C_s) does not depend on p. The solver keeps a *pool* of these options
for all q > p still reachable from p and removes, for good, every option that can
never again be on a frontier:

- [dominance] when F_{p+1} joins the pool (as q' = p + 1, the shortest segment),
  an older option (q, D, Ct) with q > q' is dropped if a new one has D' <= D,
  Ct' <= Ct and need(r, q'-1) <= need(r, q-1) for every start r < q' still to
  come. The last condition holds whenever v_{q'-1} <= v_{q-1} (`ElementArrays.v`),
  because the forward part of need is a running maximum over the segment and the
  backward part differs between the two ends only through v and the (shared,
  nondecreasing) forward scratch maximum. Where v falls (a block's parameter
  gradients outweigh its activations) the option is simply kept.
- [expiry] an option is dropped when no later start can use it: the segment would
  cross a block that does not chain from its predecessor, exceed
  `max_segment_blocks`, or already rebuild more than the budget.

Each start p turns the whole pool into candidates in one numpy pass (need(p, .)
computed for 64 starts at a time): O(pool + frontier) work per position.

Bounding (exact)
----------------
[bound] A suffix state (D, C) at p can only finish through a prefix 0..p-1 that
leaves at most budget - D resident. A checkpointed block frees at most its saved
bytes and costs at least its recompute less its skipped tail, so the fractional
knapsack "free W_p - (budget - D) bytes from blocks 0..p-1 at least cost" is a
lower bound L on the prefix's recompute (`_PrefixBound`). Given an upper bound U
(the cost of any feasible plan), a state with C + L > U, and a pool option whose
bound for every later start exceeds U, can be dropped: every plan costing <= U,
so every optimal plan and its lowest-peak tie, survives. U comes from a *beam*
run of the same DP keeping the `_BEAM` states of least C + L per position.

Cost and exactness
------------------
Uniform and repeated-profile chains (ties everywhere) keep frontiers of about n/2
states. Chains whose blocks differ slightly in both bytes and recompute (measured
`ms` costs, jittered profiles) behave like strongly correlated knapsacks: the exact
frontier grows roughly quadratically with n (timings: benchmarks/chain_planner.py).
Bytes are int64; recompute in `flops` is int64 (float64 only if the sum of all
block FLOPs exceeds 2**62); in `time` each block's estimate (its all-gather under
sharding included, `recompute_cost.block_recompute`) is rounded to whole
nanoseconds and summed as int64. In `ms` costs are float64 prefix sums, so two
plans whose costs differ only by rounding may be ordered either way. The oracles
this solver is tested against (a forward DP, brute force) are in tests/oracles.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lightning_ckpt.planning.costs import StepCost
from lightning_ckpt.planning.memory_model import (
    ElementArrays,
    element_arrays,
    segment_need_rows,
)
from lightning_ckpt.planning.recompute_cost import (
    block_recompute,
    metric_rates,
    segment_overhead,
    skipped_tail,
)

Segments = list[tuple[int, int]]

_INT_LIMIT = 2**62
_NS_PER_MS = 1e6


@dataclass(frozen=True)
class ChainSolution:
    """The optimum: least recompute `cost`, its (lowest) predicted `peak_bytes`, the plan."""

    cost: float
    peak_bytes: int
    segments: Segments


@dataclass
class _Arrays(ElementArrays):
    """The element form's columns plus what the DP adds: chaining and recompute."""

    next_break: np.ndarray  # first block k > p that does not chain from k - 1 (n if none)
    rc: np.ndarray  # block recompute
    tails: np.ndarray  # skipped tail when the block ends a segment
    P: np.ndarray  # prefix sums of block recompute (n + 1)
    K: np.ndarray  # K[q] = P[q] - tail[q - 1] + segment overhead (n + 1, K[0] unused)
    cost_scale: float = 1.0  # solver cost units per unit of the metric (time: ns per ms)


def _arrays(cost: StepCost, metric: str) -> _Arrays:
    blocks = cost.blocks
    n = len(blocks)
    rates = metric_rates(cost, metric)
    rc = [block_recompute(b, metric, rates) for b in blocks]
    tails = [skipped_tail(b, metric, rates) for b in blocks]
    # [constraint] every segment ends at exactly one block: its fixed overhead goes with the end
    seg = segment_overhead(metric, rates) if metric == "time" else 0  # an int: FLOPs stay exact
    scale = 1.0
    if metric == "time":
        # [exactness] estimated times in whole nanoseconds, summed as int64: plans of
        # equal cost tie exactly, so the lower peak wins and not a rounding error
        scale = _NS_PER_MS
        rc = [int(round(c * scale)) for c in rc]
        tails = [int(round(c * scale)) for c in tails]
        seg = int(round(seg * scale))
    integral = metric != "ms" and all(isinstance(c, int) for c in rc + tails) and sum(rc) + sum(tails) < _INT_LIMIT
    cdt = np.int64 if integral else np.float64
    P = np.zeros(n + 1, dtype=cdt)
    np.cumsum(np.array(rc, dtype=cdt), out=P[1:])
    K = np.zeros(n + 1, dtype=cdt)
    K[1:] = P[1:] - np.array(tails, dtype=cdt) + seg
    next_break = np.full(n, n, dtype=np.int64)
    nb = n
    for k in range(n - 1, -1, -1):
        next_break[k] = nb
        if not blocks[k].chains_from_previous:
            nb = k
    mem = element_arrays(cost)
    return _Arrays(
        **vars(mem), next_break=next_break, rc=np.array(rc, dtype=cdt), tails=np.array(tails, dtype=cdt), P=P, K=K,
        cost_scale=scale,
    )


class _PrefixBound:
    """Lower bounds on the recompute of a prefix that must leave at most h bytes resident.

    [constraint] the blocks before p leave W_p bytes resident when all are kept; a
    checkpointed block i leaves 0 or its input instead of saved_i, so it frees at most
    saved_i, and it costs at least rc_i - tail_i. The fractional knapsack over the
    blocks before p (free at least W_p - h bytes at the least cost, items divisible)
    is a relaxation of every prefix plan, hence a lower bound: a convex piecewise
    linear function of the bytes to free, evaluated with `np.interp`. It is +inf when
    even checkpointing every block cannot free enough. Values are float64 and
    compared with a margin (`slack`).
    """

    def __init__(self, a: _Arrays):
        w = a.saved.astype(np.float64)
        c = a.rc.astype(np.float64) - a.tails.astype(np.float64)
        self.W = a.W.astype(np.float64)
        neg = c < 0  # never with non-negative FLOPs and tails; kept for exactness
        self.neg_w = np.concatenate(([0.0], np.cumsum(np.where(neg, w, 0.0))))
        self.neg_c = np.concatenate(([0.0], np.cumsum(np.where(neg, c, 0.0))))
        useful = ~neg & (w > 0)
        ratio = np.where(useful, c / np.where(w > 0, w, 1.0), np.inf)
        order = np.argsort(ratio, kind="stable")
        self.order = order[useful[order]]
        self.w, self.c = w, c
        self.slack = 1e-9 * (1.0 + float(np.abs(c).sum()))
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _table(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        tab = self._cache.get(p)
        if tab is None:
            if len(self._cache) > 2:  # the DP walks p downwards and asks for p and p + 1
                self._cache = {k: t for k, t in self._cache.items() if k <= p + 1}
            sel = self.order[self.order < p]
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


def solve_chain(
    cost: StepCost,
    budget_bytes: int,
    metric: str = "flops",
    max_segment_blocks: int | None = None,
    stats: dict | None = None,
    beam: int | None = None,
) -> ChainSolution | None:
    """Least recompute within `budget_bytes`, ties broken by the lowest peak; None if nothing fits.

    [bound] First a beam run (the same DP keeping only the few most promising states
    per position) finds a good feasible plan; its cost is an upper bound U. Then the
    exact run drops every partial plan that cannot finish at a cost <= U (its cost
    so far plus the prefix lower bound exceeds U). Every plan costing <= U, hence
    every optimal plan, survives all pruning, so the exact run's answer is the
    optimum with the lowest peak. Without a beam plan the exact run is uncapped.
    """
    a = _arrays(cost, metric)
    budget = int(budget_bytes)
    end_relief = int(a.o[a.n])  # a kept last block may already hold what the head runs on
    if a.opt_need > budget or a.end_need - end_relief > budget:
        return None
    max_len = a.n if max_segment_blocks is None else max(1, int(max_segment_blocks))
    lb = _PrefixBound(a)
    if lb.total(budget - a.end_need + end_relief) == math.inf:
        return None
    if stats is not None:
        stats.clear()
    cap = math.inf
    if beam is None:
        beam = _BEAM if a.n >= _BEAM_FROM else 0
    if beam:
        guess = _solve(a, budget, max_len, math.inf, lb, stats, beam=beam)
        if guess is not None:
            cap = guess.cost
            if stats is not None:
                stats["beam_cost"] = guess.cost
    found = _solve(a, budget, max_len, cap, lb, stats)
    if found is None and cap != math.inf:  # cannot happen (the beam plan survives); stay exact anyway
        found = _solve(a, budget, max_len, math.inf, lb, stats)
    return found


_BEAM = 16  # states kept per position by the bounding run
_BEAM_FROM = 64  # shorter chains are solved in one uncapped run (`beam=0`)


def _solve(
    a: _Arrays, budget: int, max_len: int, cap: float, lb: _PrefixBound, stats: dict | None, beam: int = 0
) -> ChainSolution | None:
    """The backward Pareto DP (see the module docstring); `cap`/`beam` as in `solve_chain`."""
    n = a.n
    cdt = a.P.dtype
    i64 = np.int64
    capped = cap != math.inf
    cap_eff = cap + lb.slack if capped else math.inf
    c_top = np.iinfo(i64).max if cdt == i64 else np.inf
    v_rises = bool(np.all(a.v[1:] >= a.v[:-1])) if n > 1 else True
    # A state's back pointer: (q << 33) | (segment << 32) | (IDX - index in F_q): the plan
    # goes on at position q after "keep block p" (q = p + 1) or after "segment [p, q - 1]".
    # (IDX - index keeps the pool's pointers sorted, falling, so searchsorted can cut it.)
    if n + 1 >= (1 << 29):
        raise ValueError("chain too long for the planner's back pointers")
    QS, SEG, IDX = 33, 1 << 32, (1 << 32) - 1
    ar = np.arange(max(64, n + 2), dtype=i64)

    # The ends reachable from each start, fixed by the budget alone.
    p_all = np.arange(n, dtype=i64)
    room = budget - a.static - a.outside_grad
    # [expiry] for every start <= p: the segment may not cross a block that does not
    # chain, exceed max_len, or rebuild blocks p+1..b beyond the budget. These limits
    # only tighten as p decreases, so an option past them is gone for good.
    forever = np.minimum(np.minimum(a.next_break - 1, p_all + max_len - 1), n - 1)
    forever = np.minimum(forever, np.searchsorted(a.W, room + a.W[1:], side="right") - 2)
    # exact for this start: the rebuilt interior alone (with its boundary) must fit
    # (less what a kept predecessor may already hold of the boundary)
    reach = np.minimum(forever, np.searchsorted(a.W, room - a.x + a.xs + a.o[:-1] + a.W[:-1], side="right") - 2)
    widths = np.maximum(reach - p_all + 1, 0)
    need_rows = None
    need_p0 = n

    FD: list = [None] * (n + 1)
    FC: list = [None] * (n + 1)
    FB: list = [None] * (n + 1)
    FD[n] = np.array([a.end_need], dtype=i64)
    FC[n] = np.zeros(1, dtype=cdt)
    # the end acts as a segment start whose boundary is the last block's output (`o[n]`)
    FB[n] = np.full(1, SEG, dtype=i64)

    # The pool of segment continuations: option (D, Ct = K_q + C, back pointer to F_q),
    # in the order of insertion: the pointers (q in the high bits) fall along it.
    pool_d = np.zeros(0, dtype=i64)
    pool_c = np.zeros(0, dtype=cdt)
    pool_b = np.zeros(0, dtype=i64)
    pool_cap = 4 * beam

    for p in range(n - 1, -1, -1):
        q1 = p + 1
        nd, nc = FD[q1], FC[q1]
        m = nd.shape[0]
        if m > ar.shape[0]:
            ar = np.arange(2 * m, dtype=i64)
        keep_b = ((q1 << QS) + IDX) - ar[:m]
        # states of F_q whose suffix starts with a segment (the others keep block q)
        seg_q = (FB[q1] & SEG) != 0
        # ---- the new options (segments ending at p, i.e. q = p + 1). Block p is then
        # checkpointed, so a suffix that keeps block q also holds what q shares with p.
        if m:
            opt_d, opt_c, opt_b = _pareto_prune(nd + np.where(seg_q, 0, a.sh[q1]), nc + a.K[q1], keep_b)
            if pool_d.shape[0]:
                # [dominance] older (longer) options beaten by a new one, where valid.
                ext = np.empty(opt_d.shape[0] + 1, dtype=cdt)
                ext[0] = c_top
                ext[1:] = opt_c
                beaten = ext[np.searchsorted(opt_d, pool_d, side="right")] <= pool_c
                if not v_rises:
                    beaten &= a.v[p] <= a.v[(pool_b >> QS) - 1]
                if beaten.any():
                    live = ~beaten
                    pool_d, pool_c, pool_b = pool_d[live], pool_c[live], pool_b[live]
            pool_d = np.concatenate((pool_d, opt_d))
            pool_c = np.concatenate((pool_c, opt_c))
            pool_b = np.concatenate((pool_b, opt_b))

        if pool_d.shape[0]:
            # [expiry] options ending past `forever[p]` (they sit at the front of the pool)
            cut = pool_b.shape[0] - int(np.searchsorted(pool_b[::-1], (int(forever[p]) + 2) << QS, side="left"))
            if cut:
                pool_d, pool_c, pool_b = pool_d[cut:], pool_c[cut:], pool_b[cut:]
            if (capped or (beam and pool_d.shape[0] > pool_cap)) and pool_d.shape[0]:
                # [expiry] whatever start r <= p the segment gets, blocks r..p and the
                # prefix before r form a prefix of p + 1 blocks leaving <= budget - D.
                score = pool_c - a.P[q1] + lb.bound(q1, budget - pool_d)
                alive = _within(score, cap_eff, pool_cap if beam else 0)
                if not alive.all():
                    pool_d, pool_c, pool_b = pool_d[alive], pool_c[alive], pool_b[alive]

        # ---- candidates: keep block p (a suffix that opens a segment at q finds its
        # boundary resident when p saved it), then every pool option that reaches p as
        # a segment. The two kinds are pruned apart: the element before p shifts them
        # differently (`memory_model.boundary_shifts`).
        kd = np.maximum(a.keep_need[p], a.saved[p] + nd - np.where(seg_q, a.o[q1], 0))
        ok = kd <= budget
        if capped:
            ok &= nc <= cap
        k_d, k_c, k_b = _pareto_prune(kd[ok], nc[ok], keep_b[ok])
        w = int(widths[p])
        start = pool_b.shape[0] - int(np.searchsorted(pool_b[::-1], (p + w + 1) << QS, side="left")) if w else 0
        if w and start < pool_b.shape[0]:
            if p < need_p0:  # compute need(p, .) for the next block of starts at once
                p0 = max(0, p - 63)
                width = int(widths[p0 : p + 1].max())
                need_rows, need_p0 = segment_need_rows(a, p0, p + 1, width), p0
            ob = pool_b[start:]
            sd = np.maximum(need_rows[p - need_p0][(ob >> QS) - q1], pool_d[start:] + a.x[p])
            sc = pool_c[start:] - a.P[p]
            # a kept block p - 1 may lower the demand by what it saved of the boundary
            ok = sd - a.o[p] <= budget
            if capped:
                ok &= sc <= cap
            s_d, s_c, s_b = _pareto_prune(sd[ok], sc[ok], ob[ok] | SEG)
            cand_d = np.concatenate((k_d, s_d))
            cand_c = np.concatenate((k_c, s_c))
            cand_b = np.concatenate((k_b, s_b))
            relief = np.concatenate((np.zeros(k_d.shape[0], dtype=i64), np.full(s_d.shape[0], a.o[p], dtype=i64)))
        else:
            cand_d, cand_c, cand_b = k_d, k_c, k_b
            relief = np.zeros(k_d.shape[0], dtype=i64)
        if p > 0 and cand_d.shape[0] and (capped or beam):
            # [bound] the prefix before p must leave at most budget - D resident
            # (budget - D + relief when the element before p can lower D by `relief`)
            score = cand_c + lb.bound(p, budget - cand_d + relief)
            ok = _within(score, cap_eff, beam)
            if not ok.all():
                cand_d, cand_c, cand_b = cand_d[ok], cand_c[ok], cand_b[ok]
        FD[p], FC[p], FB[p] = cand_d, cand_c, cand_b
        if stats is not None:
            key = "beam_" if beam else ""
            stats[key + "pool"] = stats.get(key + "pool", 0) + pool_d.shape[0]
            stats[key + "frontier"] = stats.get(key + "frontier", 0) + cand_d.shape[0]
            stats[key + "max_pool"] = max(stats.get(key + "max_pool", 0), pool_d.shape[0])
            stats[key + "max_frontier"] = max(stats.get(key + "max_frontier", 0), cand_d.shape[0])
        if not cand_d.shape[0] and not pool_d.shape[0]:
            return None  # nothing left to build on

    if FD[0].shape[0] == 0:
        return None
    # least cost, then the lowest demand (nothing precedes block 0: no shift)
    k = int(np.lexsort((FD[0], FC[0]))[0])
    best_cost = FC[0][k]
    peak = max(int(FD[0][k]), a.opt_need)
    segs: Segments = []
    p = 0
    while p < n:
        ptr = int(FB[p][k])
        q, k = ptr >> QS, IDX - (ptr & IDX)
        if ptr & SEG:
            segs.append((p, q - 1))
        p = q
    best = best_cost.item()
    return ChainSolution(best / a.cost_scale if a.cost_scale != 1.0 else best, peak, segs)


def _within(score: np.ndarray, cap: float, keep: int) -> np.ndarray:
    """Mask of the entries whose bounded `score` is <= `cap` and, with `keep` > 0, among
    the `keep` lowest scores (the beam run's cut)."""
    ok = score <= cap
    if keep and score.shape[0] > keep:
        best = np.zeros(score.shape[0], dtype=bool)
        best[np.argpartition(score, keep - 1)[:keep]] = True
        ok &= best
    return ok


def _pareto_prune(d: np.ndarray, c: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[recurrence] The states no other beats or equals on both D and C: D ascending,
    C strictly falling; of equal D only the least C."""
    if d.shape[0] <= 1:
        return d, c, b
    order = np.argsort(d, kind="stable")
    cs = c[order]
    keep = np.empty(cs.shape[0], dtype=bool)
    keep[0] = True
    np.less(cs[1:], np.minimum.accumulate(cs)[:-1], out=keep[1:])
    order = order[keep]
    ds = d[order]
    # equal D are not ordered by C: of a run of equal D the last kept has the least C
    if ds.shape[0] > 1:
        last = np.empty(ds.shape[0], dtype=bool)
        last[-1] = True
        np.not_equal(ds[:-1], ds[1:], out=last[:-1])
        if not last.all():
            order, ds = order[last], ds[last]
    return ds, c[order], b[order]
