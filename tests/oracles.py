"""What the memory model and the planners are checked against: slow, simple, independent.

- `walk_peak`: the step walked phase by phase (forward block by block, backward from
  the last block, optimizer step), written without the element form; the tests hold
  `memory_model.predict_peak` (the element form) to it field by field.
- `all_plans`, `brute_force`: every plan of a short chain, its peak from `walk_peak`.
- `reference_least_recompute`, `reference_optimal_segments`: the forward (R, C)
  Pareto DP over the scalar elements of `memory_model`, with a budget bisection for
  the lowest-peak tie-break; the reference of `chain_planner.solve_chain` on chains
  too long for brute force.
"""

from __future__ import annotations

import itertools
import math

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.memory_model import (
    PeakBreakdown,
    boundary_shift,
    end_need,
    end_relief,
    kept_element,
    optimizer_need,
    predict_peak,
    segment_elements,
    step_terms,
)
from lightning_ckpt.planning.peak_terms import ckpt_forward_bytes
from lightning_ckpt.planning.recompute_cost import (
    block_recompute,
    metric_rates,
    recompute_cost,
    segment_overhead,
    skipped_tail,
)

Segments = list[tuple[int, int]]


# ----------------------------------------------------------------------------- the phase walk


def walk_peak(cost: StepCost, segments: Segments) -> PeakBreakdown:
    """Peak bytes of a training step under valid `segments`, walked phase by phase."""
    blocks = cost.blocks
    n = len(blocks)
    owner = [-1] * n
    for j, (a, b) in enumerate(segments):
        for i in range(a, b + 1):
            owner[i] = j
    # storages two neighbours save count once, with the first saver: a kept block after a
    # checkpointed one holds what it shares with it; a segment after a kept block finds
    # the part of its boundary that block saved already resident
    shift = [0] * n
    for i in range(1, n):
        if owner[i] < 0 and owner[i - 1] >= 0:
            shift[i] = blocks[i].shared_with_previous_bytes
        elif owner[i] >= 0 and segments[owner[i]][0] == i and owner[i - 1] < 0:
            shift[i] = -blocks[i].input_saved_by_previous_bytes
    # what each block leaves resident after the forward: kept, what it saved; a segment, its boundary
    res = [b.saved_bytes for b in blocks]
    for a, b in segments:
        for i in range(a, b + 1):
            res[i] = 0
        res[a] = blocks[a].input_bytes
    prefix = [0] * (n + 1)
    for i in range(n):
        prefix[i + 1] = prefix[i] + res[i] + shift[i]
    static = cost.static_bytes + cost.batch_bytes + cost.pre_saved_bytes
    grads_all = cost.grad_bytes

    # forward: every block's resident bytes plus the head, with last step's grads still
    # allocated (or those earlier micro-batches accumulated); during block i its own
    # scratch is live as well
    fwd_grads = grads_all if cost.grads_live_in_forward or cost.grads_accumulate else 0
    # a micro-batch that accumulates finds every gradient allocated from its first backward on
    head_grads = grads_all if cost.grads_accumulate else cost.head_outside_grad_bytes
    relief = blocks[-1].output_saved_bytes if n and owner[-1] < 0 else 0
    post = cost.post_saved_bytes - relief
    post_fwd = cost.post_saved_bytes if cost.post_forward_bytes is None else cost.post_forward_bytes
    fwd = prefix[n] + post_fwd - relief + cost.carried_end_bytes
    for i, blk in enumerate(blocks):
        if owner[i] < 0:
            own = blk.saved_bytes + blk.output_bytes - blk.output_saved_bytes + blk.fwd_transient_bytes + shift[i]
            own += blk.input_unsaved_bytes  # the part of its input only the caller holds
        else:
            own = blk.input_bytes + ckpt_forward_bytes(blk)
            if segments[owner[i]][0] == i:
                own += shift[i]
        fwd = max(fwd, prefix[i] + own + blk.carried_fwd_bytes)
        if i + 1 < n and (owner[i] < 0 or owner[i + 1] != owner[i]):
            # the modules outside the chain before block i + 1, on what blocks 0..i leave (never
            # inside a segment: a block after such modules does not chain)
            fwd = max(fwd, prefix[i + 1] + blocks[i + 1].gap_fwd_bytes - (blk.output_saved_bytes if owner[i] < 0 else 0))
    fwd += static + fwd_grads
    fwd = max(fwd, static + head_grads + prefix[n] + post + cost.carried_end_bytes)  # the head's backward

    # backward: blocks from last to first; gradients of later blocks exist (all of them
    # when accumulating: then no block adds its own)
    grads_after = head_grads
    own_grads = 0 if cost.grads_accumulate else 1

    def scratch_of(blk) -> int:  # into kept gradients autograd frees each new one once it is added
        kept = blk.kept_grads_bwd_transient_bytes
        return kept if cost.grads_accumulate and kept is not None else blk.bwd_transient_bytes

    bwd, bwd_at = 0, -1
    i = n - 1
    while i >= 0:
        j = owner[i]
        if j < 0:
            blk = blocks[i]
            live = prefix[i] + blk.saved_bytes + shift[i] + blk.output_bytes + scratch_of(blk)
            live += blk.carried_bwd_bytes
            if live + grads_after > bwd:
                bwd, bwd_at = live + grads_after, i
            grads_after += own_grads * (blk.grad_bytes + blk.gap_grad_bytes)
            i -= 1
            continue
        a, b = segments[j]
        # the segment's interior is rebuilt at once; the boundary input is not counted twice
        rebuilt = sum(blocks[k].saved_bytes for k in range(a, b + 1)) - blocks[a].input_saved_bytes
        base = prefix[a] + blocks[a].input_bytes + shift[a]
        # a recompute that stops at a block's last save holds its scratch, and its output when made by then
        scratch = max(blocks[k].fwd_transient_bytes + blocks[k].stop_output_bytes for k in range(a, b + 1))
        for k in range(b, a - 1, -1):
            blk = blocks[k]
            extra = max(scratch_of(blk), scratch) if k == b else scratch_of(blk)
            live = base + rebuilt + blk.output_bytes + extra + blk.carried_bwd_bytes
            if live + grads_after > bwd:
                bwd, bwd_at = live + grads_after, k
            rebuilt -= blk.saved_bytes - (blk.input_saved_bytes if k == a else 0)
            grads_after += own_grads * (blk.grad_bytes + blk.gap_grad_bytes)
        i = a - 1
    bwd += static

    opt = cost.static_bytes + cost.batch_bytes + grads_all + cost.optimizer_transient_bytes
    peak = max(fwd, bwd, opt)
    phase = "forward" if peak == fwd else ("optimizer" if peak == opt else f"backward:{blocks[bwd_at].name}")
    return PeakBreakdown(int(peak), phase, int(fwd), int(bwd), int(opt))


# ----------------------------------------------------------------------------- brute force


def all_plans(n: int):
    """Every plan of a chain of n blocks: each gap is 'kept', 'new segment' or 'same segment'."""
    for labels in itertools.product((0, 1), repeat=n):  # 1 = checkpointed
        ck = [i for i in range(n) if labels[i]]
        # between consecutive checkpointed neighbours we may cut or not
        joints = [i for i in ck if i - 1 in ck]
        for cuts in itertools.product((False, True), repeat=len(joints)):
            cut = dict(zip(joints, cuts))
            segs: list[tuple[int, int]] = []
            for i in ck:
                if segs and segs[-1][1] == i - 1 and not cut[i]:
                    segs[-1] = (segs[-1][0], i)
                else:
                    segs.append((i, i))
            yield segs


def chainable(cost: StepCost, segs: Segments) -> bool:
    """A segment may only span blocks that take the previous block's output."""
    return all(cost.blocks[i].chains_from_previous for a, b in segs for i in range(a + 1, b + 1))


def brute_force(cost: StepCost, budget: int):
    """((least recompute, lowest peak), plan) over every valid plan within `budget`, or None."""
    best = None
    for segs in all_plans(cost.n_blocks):
        if not chainable(cost, segs):
            continue
        peak = walk_peak(cost, segs).peak_bytes
        if peak > budget:
            continue
        key = (recompute_cost(cost, segs), peak)
        if best is None or key < best[0]:
            best = (key, segs)
    return best


# ----------------------------------------------------------------------------- reference DP


def _elements(cost: StepCost, a: int, terms, max_len: int, metric: str, room: float):
    """(element, recompute) for kept block `a` and every segment starting at `a` that
    chains, is at most `max_len` blocks long, and whose rebuilt interior alone fits `room`."""
    rates = metric_rates(cost, metric)
    blocks = cost.blocks
    yield kept_element(cost, a, terms), 0.0
    head = blocks[a]
    # the smallest base any predecessor allows (a kept one may already hold the boundary)
    least_base = cost.static_bytes + cost.batch_bytes + cost.pre_saved_bytes + head.input_bytes - head.input_saved_bytes
    least_base -= head.input_saved_by_previous_bytes
    saved_sum, run_cost = 0, 0.0
    for el in segment_elements(cost, a, terms):
        b = el.last
        if b - a >= max_len or (b > a and not blocks[b].chains_from_previous):
            break
        saved_sum += blocks[b].saved_bytes
        if least_base + min(terms.gradients_after, default=0) + saved_sum > room:
            break  # the rebuilt interior only grows with the segment
        run_cost += block_recompute(blocks[b], metric, rates)
        yield el, run_cost - skipped_tail(blocks[b], metric, rates) + segment_overhead(metric, rates)


def reference_least_recompute(
    cost: StepCost, budget_bytes: int, metric: str = "flops", max_segment_blocks: int | None = None, cost_cap: float = math.inf
) -> tuple[float, Segments] | None:
    """(least recompute, a plan reaching it) within `budget_bytes`, or None.

    [recurrence] walking the chain left to right, the state after a prefix is (bytes
    left resident R, recompute spent C, whether its last block is kept); an element e
    (keep the next block, or open a segment) is feasible iff R + need_e + shift_e <=
    budget and moves to (R + resident_e + shift_e, C + cost_e). A state is dropped
    when another with the same last-block kind has R' <= R and C' <= C: every later
    constraint depends on the prefix only through R and that kind, so the Pareto
    frontier is exact. States costing more than `cost_cap` are dropped too.
    """
    n = cost.n_blocks
    max_len = n if max_segment_blocks is None else max(1, max_segment_blocks)
    terms = step_terms(cost)
    if optimizer_need(cost) > budget_bytes:
        return None
    # frontier[p]: (R, C, back, last_kept), back = (prev_position, prev_state_index, element)
    frontier: list[list[tuple]] = [[] for _ in range(n + 1)]
    frontier[0] = [(0, 0.0, None, False)]
    for p in range(n):
        states = frontier[p]
        if not states:
            continue
        room = budget_bytes - min(st[0] for st in states)
        elements = list(_elements(cost, p, terms, max_len, metric, room))
        for si, (r, c, _, last_kept) in enumerate(states):
            for el, el_cost in elements:
                shift = boundary_shift(cost, p, el.checkpointed, last_kept)
                if r + el.need_bytes + shift <= budget_bytes and c + el_cost <= cost_cap:
                    frontier[el.last + 1].append((r + el.resident_bytes + shift, c + el_cost, (p, si, el), not el.checkpointed))
        # position p + 1 has received from every source: prune it, kept and checkpointed apart
        nxt = frontier[p + 1]
        frontier[p + 1] = _pareto([st for st in nxt if st[3]]) + _pareto([st for st in nxt if not st[3]])
    end = end_need(cost)
    finals = [st for st in frontier[n] if st[0] + end - end_relief(cost, st[3]) <= budget_bytes]
    if not finals:
        return None
    best = min(finals, key=lambda st: (st[1], st[0]))
    return best[1], _backtrack(frontier, best)


def _pareto(states: list[tuple]) -> list[tuple]:
    """The states no other beats or equals on both resident bytes and cost."""
    states.sort(key=lambda st: (st[1], st[0]))
    kept: list[tuple] = []
    for st in states:
        if not kept or st[0] < kept[-1][0]:  # kept: rising cost, falling resident bytes
            kept.append(st)
    return kept


def _backtrack(frontier, state) -> Segments:
    segs = []
    s = state
    while s[2] is not None:
        p, si, el = s[2]
        if el.checkpointed:
            segs.append((el.first, el.last))
        s = frontier[p][si]
    return sorted(segs)


def reference_optimal_segments(
    cost: StepCost, budget_bytes: int, metric: str = "flops", max_segment_blocks: int | None = None
) -> Segments | None:
    """The least recompute C* from the reference DP, then the lowest peak by bisecting
    the budget (the smallest budget at which C* is still reachable is the lowest peak
    of any plan costing C*). None when nothing fits."""
    found = reference_least_recompute(cost, budget_bytes, metric, max_segment_blocks)
    if found is None:
        return None
    best_c, segs = found
    hi = predict_peak(cost, segs).peak_bytes
    lo = cost.static_bytes - 1
    cap = best_c + 1e-9 * max(1.0, abs(best_c))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        trial = reference_least_recompute(cost, mid, metric, max_segment_blocks, cost_cap=cap)
        if trial is not None:
            hi, segs = predict_peak(cost, trial[1]).peak_bytes, trial[1]
        else:
            lo = mid
    return segs


# ----------------------------------------------------------------------------- nested plans


def inner_plans(cost: StepCost, a: int, b: int, levels: int):
    """Every set of inner segments of segment [a, b] nesting at most `levels` - 1 more
    levels (only [] when `levels` is 1 or the segment has one block)."""
    if levels <= 1 or a == b:
        yield []
        return

    def rest(p: int):
        if p > b:
            yield []
            return
        yield from rest(p + 1)  # block p saves in the recompute
        for e in range(p, b + 1):
            if (p, e) == (a, b):
                continue
            if e > p and not cost.blocks[e].chains_from_previous:
                break
            for sub in inner_plans(cost, p, e, levels - 1):
                for tail in rest(e + 1):
                    yield [(p, e), *sub, *tail]

    yield from rest(a)


def all_nested_plans(cost: StepCost, levels: int):
    """Every (segments, inner segments) of the chain, segments nested at most `levels` deep."""
    n = cost.n_blocks

    def rest(p: int):
        if p >= n:
            yield [], []
            return
        yield from rest(p + 1)
        for e in range(p, n):
            if e > p and not cost.blocks[e].chains_from_previous:
                break
            for sub in inner_plans(cost, p, e, levels):
                for segs, inner in rest(e + 1):
                    yield [(p, e), *segs], [*sub, *inner]

    yield from rest(0)


def nested_plan_table(cost: StepCost, levels: int, metric: str = "flops") -> list[tuple[int, float, list, list]]:
    """(peak, recompute, segments, inner) of every nested plan, each evaluated with `predict_peak`
    and `recompute_cost`, in the order `all_nested_plans` gives them: one table serves any budget."""
    table = []
    for segs, inner in all_nested_plans(cost, levels):
        inner = sorted(inner)
        peak = predict_peak(cost, segs, None, inner).peak_bytes
        table.append((peak, recompute_cost(cost, segs, metric, None, inner), segs, inner))
    return table


def brute_force_nested(cost: StepCost, budget: int, levels: int, metric: str = "flops", table=None):
    """(least recompute, segments, inner) over every nested plan within `budget`, or None;
    `table`: `nested_plan_table(cost, levels, metric)` when it is already made."""
    best = None
    for peak, c, segs, inner in nested_plan_table(cost, levels, metric) if table is None else table:
        if peak <= budget and (best is None or c < best[0]):
            best = (c, segs, inner)
    return best
