"""Exact, fast chain planner: the `optimal` policy for the memory model of `memory_model`.

The problem: a plan is a sequence of elements ("keep block p", "checkpoint segment
[p, b]") whose needs, resident bytes and shifts are `memory_model`'s element form
(`element_arrays`: `element_arrays`, `segment_need_rows`; docs/design.md); its peak is
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
leaves at most budget - D resident; `prefix_bound.ChainBound` (a Lagrangian bound
over prefix plans, each segment paying for its boundary) is a lower bound L on that
prefix's recompute. A run capped at U drops a state with C + L > U, and a pool option
whose bound for every later start exceeds U: every plan costing <= U survives. The
cap comes first from the bound of the whole chain (`_deepen`: caps just above it find
the optimum fast or prove that it costs more), last from a *beam* run of the same DP
keeping the `_BEAM` states of least C + L per position, whose plan costs U.

Cost and exactness
------------------
Chains whose blocks differ slightly in bytes and recompute (measured `ms` costs,
jittered profiles) behave like strongly correlated knapsacks: their frontiers grow fast
with n and only a tight cap keeps them small (benchmarks/chain_planner.py). Bytes are
int64; recompute in `flops` is int64 (float64 only past 2**62); in `time` each block's
estimate (`recompute_cost.block_recompute`) is rounded to whole nanoseconds and summed
as int64; in `ms` costs are float64, so plans whose costs differ only by rounding may
be ordered either way. The oracles (a forward DP, brute force) are in tests/oracles.py.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from lightning_ckpt.planning.all_kept import all_kept_optimum
from lightning_ckpt.planning.chain_arrays import ChainArrays, chain_arrays
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.element_arrays import segment_need_rows
from lightning_ckpt.planning.op_options import OpKey
from lightning_ckpt.planning.pareto_front import pareto_order, pareto_prune, within
from lightning_ckpt.planning.prefix_bound import ChainBound, chain_bound

Segments = list[tuple[int, int]]


@dataclass(frozen=True)
class ChainSolution:
    """The optimum: least recompute `cost`, its (lowest) predicted `peak_bytes`, the plan
    (`segments`, and the op calls `keeps` keeps in blocks checkpointed alone)."""

    cost: float
    peak_bytes: int
    segments: Segments
    keeps: dict[int, tuple[OpKey, ...]] = field(default_factory=dict)
    lower_bound: float | None = None  # when the time limit stopped the search: no plan costs less

    @property
    def gap(self) -> float:
        """How far above the optimum this plan may be, relative to its cost (0.0: exact)."""
        if self.lower_bound is None or self.cost <= 0:
            return 0.0
        return max(0.0, (self.cost - self.lower_bound) / self.cost)


class _OutOfTime(Exception):
    """The exact run passed its deadline; carries the lower bound it had proven (solver units)."""

    def __init__(self, lower_bound: float) -> None:
        super().__init__(lower_bound)
        self.lower_bound = lower_bound


def solve_chain(
    cost: StepCost,
    budget_bytes: int,
    metric: str = "flops",
    max_segment_blocks: int | None = None,
    stats: dict | None = None,
    beam: int | None = None,
    granularity: str = "block",
    max_options: int | None = None,
    time_limit_s: float | None = None,
) -> ChainSolution | None:
    """Least recompute within `budget_bytes`, ties broken by the lowest peak; None if nothing fits.

    granularity="op" adds, for every block, its op-level options (`op_options`: keep some
    op outputs, recompute the rest) as one-block segments of their own resident and
    cost; `max_options` caps how many of each block's frontier are offered.

    time_limit_s: when the exact runs are still going after this long, return the beam
    run's plan with `lower_bound`, the least cost any plan could have (proven by the runs
    that found nothing, the states not yet extended and everything pruned); `gap` says
    how far above the optimum it can be.

    [bound] A beam run (the same DP keeping only the most promising states per position)
    finds a plan of cost U; exact runs capped between the bound of the whole chain and U
    then find the optimum with the lowest peak (`_deepen`). Short chains: one uncapped run.
    """
    budget = int(budget_bytes)
    if stats is None and beam is None and granularity == "block":
        # the common case, from the cost alone: keeping every block fits and is the optimum
        found = all_kept_optimum(cost, budget, metric)
        if found is not None:
            if max_segment_blocks is not None:
                int(max_segment_blocks)  # a value that is no number fails as below
            return ChainSolution(found[0], found[1], [], {})
    a = chain_arrays(cost, metric, granularity, max_options)
    end_relief = int(a.o[a.n])  # a kept last block may already hold what the head runs on
    if a.opt_need > budget or a.end_need - end_relief > budget:
        return None
    max_len = a.n if max_segment_blocks is None else max(1, int(max_segment_blocks))
    if stats is None and beam is None and (kept := _all_kept(a, budget)) is not None:
        # before the bound: keeping every block fits, so it leaves W[n] <= budget - end_need + end relief
        # resident, which `reaches` below grants (the most a plan frees is never below 0)
        return kept
    lb = chain_bound(a)
    if not lb.reaches(a.n, budget - a.end_need + end_relief):
        return None
    if stats is not None:
        stats.clear()
    deadline = None if time_limit_s is None else time.perf_counter() + float(time_limit_s)
    if beam is None:
        beam = _BEAM if a.n >= _BEAM_FROM else 0
    guess = _solve(a, budget, max_len, math.inf, lb, stats, beam=beam) if beam else None
    if stats is not None and guess is not None:
        stats["beam_cost"] = guess[1].cost
    try:
        found = _deepen(a, budget, max_len, lb, stats, math.inf if guess is None else guess[0], deadline)
    except _OutOfTime as stop:
        if guess is None:  # no plan yet: the bounding run's, found fast
            guess = _solve(a, budget, max_len, math.inf, lb, None, beam=_BEAM)
        if guess is None:
            return None  # the beam found nothing; a plan may exist, but none in time
        bound = min(stop.lower_bound, guess[0])
        return dataclasses.replace(guess[1], lower_bound=bound / a.cost_scale if a.cost_scale != 1.0 else bound)
    return None if found is None else found[1]


def _all_kept(a: ChainArrays, budget: int) -> ChainSolution | None:
    """The plan that checkpoints nothing, when it fits and is the optimum `_solve` would return: every
    segment costs more than 0 and no op option can lower a cost, so it is the only plan of cost 0. Its
    demand is the DP's over "keep" elements only (`_solve`), without running the DP."""
    if a.n == 0 or any(k.shape[0] for k in a.opt_k):
        return None
    seg_cost = a.K[1:] - np.maximum.accumulate(a.P[:-1])  # the cheapest segment ending at each block
    if not bool(np.all(seg_cost > 0)):
        return None
    d = int(a.end_need)
    for p in range(a.n - 1, -1, -1):  # the end counts as a segment start: the last block's output held there
        d = max(int(a.keep_need[p]), int(a.saved[p]) + d - (int(a.o[a.n]) if p == a.n - 1 else 0))
        if d > budget:
            return None
    best = np.zeros(1, dtype=a.P.dtype)[0].item()
    return ChainSolution(best / a.cost_scale if a.cost_scale != 1.0 else best, max(d, a.opt_need), [], {})


def _deepen(
    a: ChainArrays, budget: int, max_len: int, lb: ChainBound, stats: dict | None, upper: float, deadline: float | None
) -> tuple[float, ChainSolution] | None:
    """The exact run under caps rising from the bound of the whole chain (no plan costs less)
    to `upper` (a plan's cost; inf: one uncapped run).

    [bound] A run capped at c keeps every plan costing <= c: it returns the optimum if that
    costs <= c, else nothing, proving that every plan costs more. The lower the cap the
    fewer states survive, so caps start 1/`_FIRST_STEP` of the way to `upper` and double
    their distance from the last proven floor; past halfway, or `_DEEPEST` above the floor,
    the last run is capped at `upper`. Integral costs are multiples of their greatest common
    divisor, and so is every plan's: the floor rounds up to one, caps down.
    """
    floor = -math.inf if upper == math.inf else lb.total(budget - a.end_need + int(a.o[a.n])) - lb.slack
    g = _cost_grid(a)
    lo = math.ceil(floor / g) * g if g and floor > -math.inf else floor
    top, step = min((lo + upper) / 2, lo + _DEEPEST * abs(upper)), (upper - lo) / _FIRST_STEP
    try:
        while upper < math.inf and 0 < step and lo + step <= top:
            cap = int((lo + step) // g * g) if g else lo + step
            found = _solve(a, budget, max_len, cap, lb, stats, deadline=deadline)
            if found is not None:
                return found
            lo, step = cap + g, 2 * step  # no plan costs <= cap
        found = _solve(a, budget, max_len, upper, lb, stats, deadline=deadline)
        if found is None and upper != math.inf:  # cannot happen (the beam plan survives); stay exact anyway
            found = _solve(a, budget, max_len, math.inf, lb, stats, deadline=deadline)
        return found
    except _OutOfTime as stop:
        raise _OutOfTime(max(lo, stop.lower_bound)) from None


def _cost_grid(a: ChainArrays) -> int:
    """The greatest common divisor of every cost term when costs are integral (else 0)."""
    if a.P.dtype != np.int64 or not a.n:
        return 0
    terms = [a.rc, a.tails, a.K[1:] - a.P[1:] + a.tails, *a.opt_v]
    return int(np.gcd.reduce(np.abs(np.concatenate(terms))))


_FIRST_STEP = 64  # the first cap: 1/64 of the way from the floor to the beam plan's cost
_DEEPEST = 0.005  # the optimum is rarely 0.5 % above the floor; past that the floor is loose
_BEAM = 16  # states kept per position by the bounding run
_BEAM_FROM = 64  # shorter chains are solved in one uncapped run (`beam=0`)


def _solve(
    a: ChainArrays, budget: int, max_len: int, cap: float, lb: ChainBound, stats: dict | None, beam: int = 0,
    deadline: float | None = None,
) -> tuple[float, ChainSolution] | None:
    """The backward Pareto DP (see the module docstring); `cap` (in solver units) and `beam`
    as in `solve_chain`. Returns the optimum's cost in solver units and the solution."""
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
    room = budget - a.static - a.least_bwd_grads
    # [expiry] for every start <= p: the segment may not cross a block that does not
    # chain, exceed max_len, or rebuild blocks p+1..b beyond the budget. These limits
    # only tighten as p decreases, so an option past them is gone for good.
    forever = np.minimum(np.minimum(a.next_break - 1, p_all + max_len - 1), n - 1)
    forever = np.minimum(forever, np.searchsorted(a.W, room + a.W[1:], side="right") - 2)
    # exact for this start: the rebuilt interior alone (with its boundary) must fit
    # (less what a kept predecessor may already hold of the boundary)
    reach = np.minimum(forever, np.searchsorted(a.W, room - a.x + a.xs + a.o[:-1] + a.W[:-1], side="right") - 2)
    widths = np.maximum(reach - p_all + 1, 0)
    if a.must_keep is not None:  # [constraint] no segment starts at a block that must stay kept
        widths[a.must_keep] = 0
    need_rows = None
    need_p0 = n

    FD: list = [None] * (n + 1)
    FC: list = [None] * (n + 1)
    FB: list = [None] * (n + 1)
    FO: list = [None] * (n + 1)  # per state: 0, or 1 + the op option of a block checkpointed alone
    FD[n] = np.array([a.end_need], dtype=i64)
    FC[n] = np.zeros(1, dtype=cdt)
    # the end acts as a segment start whose boundary is the last block's output (`o[n]`)
    FB[n] = np.full(1, SEG, dtype=i64)
    FO[n] = np.zeros(1, dtype=i64)

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
            opt_d, opt_c, opt_b = pareto_prune(nd + np.where(seg_q, 0, a.sh[q1]), nc + a.K[q1], keep_b)
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
                alive = within(score, cap_eff, pool_cap if beam else 0)
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
        k_d, k_c, k_b = pareto_prune(kd[ok], nc[ok], keep_b[ok])
        w = int(widths[p])
        start = pool_b.shape[0] - int(np.searchsorted(pool_b[::-1], (p + w + 1) << QS, side="left")) if w else 0
        seg_d, seg_c, seg_b, seg_o = [], [], [], []
        if w and start < pool_b.shape[0]:
            if p < need_p0:  # compute need(p, .) for the next block of starts at once
                p0 = max(0, p - 63)
                width = int(widths[p0 : p + 1].max())
                need_rows, need_p0 = segment_need_rows(a, p0, p + 1, width), p0
            ob = pool_b[start:]
            seg_d.append(np.maximum(need_rows[p - need_p0][(ob >> QS) - q1], pool_d[start:] + a.x[p]))
            seg_c.append(pool_c[start:] - a.P[p])
            seg_b.append(ob | SEG)
            seg_o.append(np.zeros(ob.shape[0], dtype=i64))
        if a.opt_k and a.opt_k[p].shape[0] and m and (a.must_keep is None or not a.must_keep[p]):
            # op-level options: block p checkpointed alone, keeping k bytes of op outputs
            # (`memory_model.selective_element`), continued by every state of F_{p+1}
            k = a.opt_k[p][:, None]
            dq = (nd + np.where(seg_q, 0, a.sh[q1]))[None, :]
            need1 = np.maximum(a.one_fwd[p] + k, a.one_bwd[p])
            seg_d.append(np.maximum(need1, a.x[p] + k + dq).ravel())
            seg_c.append(((a.K[q1] - a.P[p] - a.opt_v[p])[:, None] + nc[None, :]).ravel())
            seg_b.append(np.broadcast_to((keep_b | SEG)[None, :], (k.shape[0], m)).ravel())
            seg_o.append(np.repeat(np.arange(1, k.shape[0] + 1, dtype=i64), m))
        if seg_d:
            sd, sc, sb, so = (np.concatenate(x) for x in (seg_d, seg_c, seg_b, seg_o))
            # a kept block p - 1 may lower the demand by what it saved of the boundary
            ok = sd - a.o[p] <= budget
            if capped:
                ok &= sc <= cap
            sd, sc, sb, so = sd[ok], sc[ok], sb[ok], so[ok]
            keep = pareto_order(sd, sc)
            cand_d = np.concatenate((k_d, sd[keep]))
            cand_c = np.concatenate((k_c, sc[keep]))
            cand_b = np.concatenate((k_b, sb[keep]))
            cand_o = np.concatenate((np.zeros(k_d.shape[0], dtype=i64), so[keep]))
            relief = np.concatenate((np.zeros(k_d.shape[0], dtype=i64), np.full(keep.shape[0], a.o[p], dtype=i64)))
        else:
            cand_d, cand_c, cand_b = k_d, k_c, k_b
            cand_o = relief = np.zeros(k_d.shape[0], dtype=i64)
        if p > 0 and cand_d.shape[0] and (capped or beam):
            # [bound] the prefix before p must leave at most budget - D resident
            # (budget - D + relief when the element before p can lower D by `relief`)
            score = cand_c + lb.bound(p, budget - cand_d + relief)
            ok = within(score, cap_eff, beam)
            if not ok.all():
                cand_d, cand_c, cand_b, cand_o = cand_d[ok], cand_c[ok], cand_b[ok], cand_o[ok]
        FD[p], FC[p], FB[p], FO[p] = cand_d, cand_c, cand_b, cand_o
        if stats is not None:
            key = "beam_" if beam else ""
            stats[key + "pool"] = stats.get(key + "pool", 0) + pool_d.shape[0]
            stats[key + "frontier"] = stats.get(key + "frontier", 0) + cand_d.shape[0]
            stats[key + "max_pool"] = max(stats.get(key + "max_pool", 0), pool_d.shape[0])
            stats[key + "max_frontier"] = max(stats.get(key + "max_frontier", 0), cand_d.shape[0])
        if not cand_d.shape[0] and not pool_d.shape[0]:
            return None  # nothing left to build on
        if deadline is not None and p > 0 and time.perf_counter() > deadline:
            # [bound] every plan either has an element starting at p (a state of F_p, or one
            # pruned for costing more than `cap`) or a segment across p (a pool option)
            bound = cap
            if cand_d.shape[0]:
                relief_p = np.where((cand_b & SEG) != 0, a.o[p], 0)
                bound = min(bound, float(np.min(cand_c + lb.bound(p, budget - cand_d + relief_p))))
            if pool_d.shape[0]:
                bound = min(bound, float(np.min(pool_c - a.P[p] + lb.bound(p, budget - pool_d))))
            raise _OutOfTime(bound - lb.slack)

    if FD[0].shape[0] == 0:
        return None
    # least cost, then the lowest demand (nothing precedes block 0: no shift)
    k = int(np.lexsort((FD[0], FC[0]))[0])
    best_cost = FC[0][k]
    peak = max(int(FD[0][k]), a.opt_need)
    segs: Segments = []
    keeps: dict[int, tuple] = {}
    p = 0
    while p < n:
        ptr, opt = int(FB[p][k]), int(FO[p][k])
        if opt:
            keeps[p] = a.opt_keys[p][opt - 1]
        q, k = ptr >> QS, IDX - (ptr & IDX)
        if ptr & SEG:
            segs.append((p, q - 1))
        p = q
    best = best_cost.item()
    return best, ChainSolution(best / a.cost_scale if a.cost_scale != 1.0 else best, peak, segs, keeps)
