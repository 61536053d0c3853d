"""Choose which blocks to checkpoint and how to group them into segments.

Policies: `none`, `full`, `every_k`, `sqrt`, `greedy` and `optimal`. `optimal` is an
exact dynamic program over the chain for the memory model of `memory_model`: the
least recompute whose predicted peak fits the budget (ties: the lower peak).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_ckpt.planning.costs import StepCost, ckpt_forward_bytes
from lightning_ckpt.planning.memory_model import (
    end_need,
    predict_peak,
    segment_of,
    validate_segments,
)
from lightning_ckpt.planning.plan import BlockRow, Plan, format_bytes
from lightning_ckpt.planning.recompute_cost import (
    block_recompute,
    metric_rates,
    recompute_cost,
    segment_overhead,
    skipped_tail,
)

POLICIES = ("none", "full", "every_k", "sqrt", "greedy", "optimal")


class InfeasibleBudgetError(ValueError):
    """No plan of the requested kind fits the memory budget."""


# ----------------------------------------------------------------------------- fixed shapes


def every_k_segments(n_blocks: int, k: int) -> list[tuple[int, int]]:
    """Every block checkpointed, in consecutive segments of `k` blocks."""
    if k < 1:
        raise ValueError(f"every_k needs k >= 1, got k={k}; k is the number of blocks per segment.")
    return [(i, min(i + k - 1, n_blocks - 1)) for i in range(0, n_blocks, k)]


def sqrt_segments(n_blocks: int) -> list[tuple[int, int]]:
    """The square-root rule: about sqrt(n) segments of about sqrt(n) blocks."""
    if n_blocks == 0:
        return []
    return every_k_segments(n_blocks, max(1, round(math.sqrt(n_blocks))))


def runs_to_segments(checkpointed: Sequence[int], merge: bool) -> list[tuple[int, int]]:
    """Turn checkpointed block indices into segments: one per block, or merged runs."""
    idx = sorted(set(checkpointed))
    if not merge:
        return [(i, i) for i in idx]
    segs: list[tuple[int, int]] = []
    for i in idx:
        if segs and segs[-1][1] == i - 1:
            segs[-1] = (segs[-1][0], i)
        else:
            segs.append((i, i))
    return segs


def _chainable(cost: StepCost, segments: Sequence[tuple[int, int]]) -> bool:
    return all(cost.blocks[i].chains_from_previous for a, b in segments for i in range(a + 1, b + 1))


def _split_unchainable(cost: StepCost, segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Cut segments where a block does not take the previous block's output."""
    out = []
    for a, b in segments:
        start = a
        for i in range(a + 1, b + 1):
            if not cost.blocks[i].chains_from_previous:
                out.append((start, i - 1))
                start = i
        out.append((start, b))
    return out


# ----------------------------------------------------------------------------- greedy


def greedy_segments(cost: StepCost, budget_bytes: int, metric: str = "flops") -> list[tuple[int, int]]:
    """Checkpoint blocks in order of bytes freed per unit of recompute until the plan fits.

    The seeds' ranking rule; after each added block both groupings (one segment per
    block, merged runs) are tried and the first that fits wins.
    """
    rates = metric_rates(cost, metric)
    n = cost.n_blocks

    def ratio(i: int) -> float:
        b = cost.blocks[i]
        freed = b.saved_bytes - b.input_bytes
        c = block_recompute(b, metric, rates)
        if c > 0:
            return freed / c
        return math.inf if freed > 0 else -math.inf

    order = sorted(range(n), key=lambda i: (-ratio(i), i))
    chosen: list[int] = []
    if predict_peak(cost, []).peak_bytes <= budget_bytes:
        return []
    for i in order:
        chosen.append(i)
        for merge in (False, True):
            segs = _split_unchainable(cost, runs_to_segments(chosen, merge))
            if predict_peak(cost, segs).peak_bytes <= budget_bytes:
                return segs
    raise InfeasibleBudgetError(_infeasible_message(cost, budget_bytes, "greedy"))


# ----------------------------------------------------------------------------- optimal


@dataclass(frozen=True)
class _Element:
    first: int
    last: int
    checkpointed: bool
    resident_bytes: int  # what it leaves resident for later blocks
    need_bytes: int  # its own peak on top of the resident bytes of earlier blocks
    cost: float


def _elements_from(
    cost: StepCost, a: int, grads_after: list[int], fwd_grads: int, max_len: int, metric: str, room: float = math.inf
):
    """Kept block `a`, and every checkpointed segment starting at `a`, with their needs.

    Segments stop growing once even their rebuilt interior alone exceeds `room`.
    """
    blocks = cost.blocks
    rates = metric_rates(cost, metric)
    static = cost.static_bytes + cost.pre_saved_bytes
    blk = blocks[a]
    # [constraint] a kept block: its forward and its backward on top of earlier blocks.
    need = static + blk.saved_bytes + max(
        fwd_grads + blk.output_bytes - blk.output_saved_bytes + blk.fwd_transient_bytes,
        grads_after[a] + blk.output_bytes + blk.bwd_transient_bytes,
    )
    yield _Element(a, a, False, blk.saved_bytes, need, 0.0)
    x_a = blk.input_bytes
    base = static + x_a - blk.input_saved_bytes
    # the smallest base any predecessor allows (a kept one may already hold the boundary)
    least_base = base - blk.input_saved_by_previous_bytes
    fwd_need = 0
    saved_sum = 0  # S(a..b)
    scratch = 0  # largest forward scratch in the segment (the recompute's)
    inner = -math.inf  # max over k < b of the backward of block k, less `base`
    run_cost = 0.0
    for b in range(a, min(len(blocks), a + max_len)):
        if b > a and not blocks[b].chains_from_previous:
            break
        bb = blocks[b]
        saved_sum += bb.saved_bytes
        if least_base + cost.outside_grad_bytes + saved_sum > room:
            break  # [constraint] the rebuilt interior only grows with the segment
        run_cost += block_recompute(bb, metric, rates)
        scratch = max(scratch, bb.fwd_transient_bytes)
        # [constraint] forward without saving: each block on its input and what it makes
        # in flight; from the second block on the segment's boundary is held as well
        boundary = x_a if b > a else 0
        fwd_need = max(fwd_need, static + fwd_grads + boundary + bb.input_bytes + ckpt_forward_bytes(bb))
        # [constraint] backward of the segment: its interior is rebuilt at once on top of
        # the boundary; block k's backward then runs with blocks a..k still rebuilt.
        last = grads_after[b] + saved_sum + bb.output_bytes + max(bb.bwd_transient_bytes, scratch)
        bwd_need = base + max(inner, last)
        inner = max(inner, grads_after[b] + saved_sum + bb.output_bytes + bb.bwd_transient_bytes)
        cost_ab = run_cost - skipped_tail(bb, metric, rates) + segment_overhead(metric, rates)
        yield _Element(a, b, True, x_a, max(fwd_need, bwd_need), cost_ab)


def optimal_segments(
    cost: StepCost, budget_bytes: int, metric: str = "flops", max_segment_blocks: int | None = None
) -> list[tuple[int, int]]:
    """Exact minimum-recompute plan under the memory model; among those, the lowest peak.

    Solved by `lightning_ckpt.planning.chain_planner.solve_chain`: a backward Pareto DP over
    (suffix demand, recompute) whose frontier at the first block directly holds the
    lowest peak for every cost, so the tie-break needs no budget bisection; a pool of
    segment continuations with exact dominance and a bounding beam run plan 1,000
    transformer-like blocks in about 0.3 s (chains of near-tied but unequal blocks
    are much slower: see chain_dp's "Cost"). `_least_recompute` (below) is the
    original forward DP, kept as the reference the tests hold the fast solver to.
    """
    from lightning_ckpt.planning.chain_planner import solve_chain

    found = solve_chain(cost, budget_bytes, metric, max_segment_blocks)
    if found is None:
        raise InfeasibleBudgetError(_infeasible_message(cost, budget_bytes, "optimal"))
    return found.segments


def _least_recompute(
    cost: StepCost, budget_bytes: int, metric: str, max_segment_blocks: int | None, cost_cap: float = math.inf
) -> tuple[float, list[tuple[int, int]]] | None:
    """(least recompute, a plan reaching it) within `budget_bytes`, or None.

    The original (slow, simple) forward DP, no longer used by `optimal_segments`:
    `chain_dp._reference_optimal_segments` adds its budget-bisection tie-break and the
    tests compare the fast solver against both.

    [recurrence] walking the chain left to right, the state after a prefix is the
    pair (bytes left resident R, recompute spent C); the choice for the next block
    (keep it, or open a segment of length L) is feasible iff R + need <= budget and
    moves to (R + resident, C + cost). A state is dropped when another has R' <= R
    and C' <= C: every later constraint depends on the prefix only through R, so the
    Pareto frontier is exact. States costing more than `cost_cap` are dropped too.
    """
    n = cost.n_blocks
    max_len = n if max_segment_blocks is None else max(1, max_segment_blocks)
    grads_after = [0] * n
    acc = cost.outside_grad_bytes
    for i in range(n - 1, -1, -1):
        grads_after[i] = acc
        acc += cost.blocks[i].grad_bytes
    fwd_grads = cost.grad_bytes if cost.grads_live_in_forward else 0
    static = cost.static_bytes + cost.pre_saved_bytes
    end = end_need(cost)
    opt_need = cost.static_bytes + cost.grad_bytes + cost.optimizer_transient_bytes
    if opt_need > budget_bytes:
        return None

    # frontier[p]: list of (R, C, back, last_kept) with back = (prev_position,
    # prev_state_index, element); last_kept: block p - 1 is kept (decides the
    # `boundary_shifts` correction of the next element).
    frontier: list[list[tuple]] = [[] for _ in range(n + 1)]
    frontier[0] = [(0, 0.0, None, False)]
    for p in range(n):
        states = frontier[p]
        if not states:
            continue
        min_r = min(st[0] for st in states)
        elements = list(_elements_from(cost, p, grads_after, fwd_grads, max_len, metric, budget_bytes - min_r))
        blk = cost.blocks[p]
        for si, (r, c, _, last_kept) in enumerate(states):
            for el in elements:
                if el.checkpointed:
                    shift = -blk.input_saved_by_previous_bytes if last_kept else 0
                else:
                    shift = 0 if last_kept else blk.shared_with_previous_bytes
                if r + el.need_bytes + shift <= budget_bytes and c + el.cost <= cost_cap:
                    frontier[el.last + 1].append(
                        (r + el.resident_bytes + shift, c + el.cost, (p, si, el), not el.checkpointed)
                    )
        # [recurrence] position p+1 has received from every source (all q <= p): prune
        # it, separately by whether block p is kept (the next element's shift differs).
        frontier[p + 1] = _pareto([st for st in frontier[p + 1] if st[3]]) + _pareto(
            [st for st in frontier[p + 1] if not st[3]]
        )
    # the head runs on the last block's output, already resident if that block is kept and saved it
    last_saved = cost.blocks[-1].output_saved_bytes if n else 0
    finals = [st for st in frontier[n] if st[0] + end - (last_saved if st[3] else 0) <= budget_bytes]
    if not finals:
        return None
    best = min(finals, key=lambda st: (st[1], st[0]))
    return best[1], _backtrack(frontier, best)


def _pareto(states: list[tuple]) -> list[tuple]:
    """Keep the states no other beats or equals on both resident bytes and cost."""
    states.sort(key=lambda st: (st[1], st[0]))
    kept: list[tuple] = []
    for st in states:
        if not kept or st[0] < kept[-1][0]:  # kept: rising cost, falling resident bytes
            kept.append(st)
    return kept


def _backtrack(frontier, state) -> list[tuple[int, int]]:
    segs = []
    s = state
    while s[2] is not None:
        p, si, el = s[2]
        if el.checkpointed:
            segs.append((el.first, el.last))
        s = frontier[p][si]
    return sorted(segs)


# ----------------------------------------------------------------------------- entry point


def _infeasible_message(cost: StepCost, budget_bytes: int, policy: str) -> str:
    floor = cost.static_bytes + cost.grad_bytes + cost.optimizer_transient_bytes
    return (
        f"policy={policy!r} found no plan for batch_size={cost.batch_size} within memory_budget="
        f"{format_bytes(budget_bytes)}: parameters, gradients and optimizer state alone take "
        f"{format_bytes(floor)} and no choice of checkpointed blocks brings the activations under the rest. "
        "Lower target_batch_size or raise memory_budget."
    )


def make_plan(
    cost: StepCost,
    policy: str = "optimal",
    budget_bytes: int | None = None,
    every_k: int | None = None,
    metric: str = "flops",
    segments: Sequence[tuple[int, int]] | None = None,
) -> Plan:
    """Build the `Plan` of `policy` for `cost`.

    `none`, `full`, `sqrt` and `every_k` (with `every_k` given) have a fixed shape and
    may not fit: check `plan.fits`. `every_k` without `k` picks the smallest k that
    fits. `greedy` and `optimal` need a budget and raise `InfeasibleBudgetError`
    when nothing fits. `segments` builds a plan by hand (policy "manual").
    """
    if policy not in POLICIES and not (policy == "manual" and segments is not None):
        raise ValueError(f"policy={policy!r} is not a known policy; choose one of {', '.join(POLICIES)}.")
    metric_rates(cost, metric)  # an unknown metric, or `time` without measured rates, fails here
    n = cost.n_blocks
    needs_budget = policy in ("greedy", "optimal") or (policy == "every_k" and every_k is None)
    if needs_budget and budget_bytes is None:
        raise ValueError(f"policy={policy!r} chooses blocks to fit a budget, so it needs budget_bytes; none was given.")
    if segments is not None:
        segs = list(segments)
    elif policy == "none":
        segs = []
    elif policy == "full":
        segs = every_k_segments(n, 1)
    elif policy == "sqrt":
        segs = _split_unchainable(cost, sqrt_segments(n))
    elif policy == "every_k":
        if every_k is not None:
            segs = _split_unchainable(cost, every_k_segments(n, every_k))
        else:
            segs = _smallest_fitting_k(cost, budget_bytes)
    elif policy == "greedy":
        segs = greedy_segments(cost, budget_bytes, metric)
    else:
        segs = optimal_segments(cost, budget_bytes, metric)
    segs = validate_segments(n, segs)
    if not _chainable(cost, segs):
        raise ValueError(
            "a segment spans a block that does not take the previous block's output as its first argument; "
            "such blocks can only be checkpointed one per segment."
        )
    return build_plan(cost, segs, policy if segments is None else "manual", budget_bytes, metric)


def _smallest_fitting_k(cost: StepCost, budget_bytes: int) -> list[tuple[int, int]]:
    for k in range(1, max(cost.n_blocks, 1) + 1):
        segs = _split_unchainable(cost, every_k_segments(cost.n_blocks, k))
        if predict_peak(cost, segs).peak_bytes <= budget_bytes:
            return segs
    raise InfeasibleBudgetError(_infeasible_message(cost, budget_bytes, "every_k"))


def build_plan(
    cost: StepCost, segments: Sequence[tuple[int, int]], policy: str, budget_bytes: int | None, metric: str = "flops"
) -> Plan:
    segs = validate_segments(cost.n_blocks, segments)
    peak = predict_peak(cost, segs)
    owner = segment_of(cost.n_blocks, segs)
    rates = cost.rates  # estimated times are shown whenever the profile measured rates
    rows = tuple(
        BlockRow(
            i, b.name, owner[i] >= 0, owner[i], b.saved_bytes, b.input_bytes, int(b.fwd_flops), float(b.fwd_ms),
            fwd_mem_bytes=int(b.fwd_mem_bytes),
            fwd_rng_bytes=int(b.fwd_rng_bytes),
            fwd_est_ms=None if rates is None else block_recompute(b, "time", rates),
        )
        for i, b in enumerate(cost.blocks)
    )
    fwd_flops = int(cost.meta.get("step_fwd_flops", sum(b.fwd_flops for b in cost.blocks)))
    return Plan(
        policy=policy,
        batch_size=cost.batch_size,
        segments=tuple(segs),
        predicted_peak_bytes=peak.peak_bytes,
        peak_phase=peak.phase,
        budget_bytes=None if budget_bytes is None else int(budget_bytes),
        static_bytes=int(cost.static_bytes),
        recompute_flops=int(recompute_cost(cost, segs, "flops")),
        recompute_ms=float(recompute_cost(cost, segs, "ms")),
        step_flops=3 * fwd_flops,
        rows=rows,
        cost_metric=metric,
        recompute_est_ms=None if rates is None else float(recompute_cost(cost, segs, "time")),
        rates=None if rates is None else rates.to_dict(),
    )
