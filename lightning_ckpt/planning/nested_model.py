"""Multi-level plans: segments recomputed under an inner plan of their own.

A nested plan is a family of segments in which any two are disjoint or one lies strictly
inside the other (`validate_nested`). The top-level segments are `segments`; the others,
`inner`, are each checkpointed again inside the recompute of the smallest segment around
them (their *parent*). A segment's forward is the same with or without children: it saves
only its input. Its backward changes: its recompute saves, for each of its direct
children, only the child's input, and for each block in no child, what the block saves;
each child is rebuilt again when its own backward comes (rotor / revolve schedules).

This module adds up such a segment's backward from the terms of `peak_terms`, and its
recompute cost; `memory_model.predict_peak` and `recompute_cost.recompute_cost` use them, so a
plan with children has one definition of its peak. `nested_planner` solves over the same terms.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.peak_terms import (
    child_forward_bytes,
    kept_backward_bytes,
    recompute_end_bytes,
    recompute_scratch_bytes,
    segment_activations_bytes,
    segment_inflight_bytes,
)

Span = tuple[int, int]


def validate_nested(n_blocks: int, segments: Sequence[Span], inner_segments: Sequence[Span]) -> list[Span]:
    """The inner segments sorted, or a ValueError saying which one is wrong and why.
    `segments` are the validated top-level ones.

    Together with `segments` they must be a nested family: each inner segment lies inside a
    segment, any two are disjoint or one strictly contains the other."""
    inner = []
    for s in inner_segments:
        a, b = (int(v) for v in s)
        if a > b:
            raise ValueError(
                f"inner segment ({a}, {b}) ends before it starts; an inner segment is (first, last) "
                "with first <= last. Swap the two."
            )
        if not 0 <= a <= b < n_blocks:
            raise ValueError(
                f"inner segment ({a}, {b}) is outside the chain of {n_blocks} blocks; an inner segment is "
                f"(first, last) with 0 <= first <= last <= {n_blocks - 1}, inside one of the segments."
            )
        inner.append((a, b))
    top = {tuple(s) for s in segments}
    family = sorted([(s, False) for s in top] + [(s, True) for s in inner], key=lambda e: (e[0][0], -e[0][1], e[1]))
    open_spans: list[tuple[Span, bool]] = []
    for (a, b), is_inner in family:
        while open_spans and open_spans[-1][0][1] < a:
            open_spans.pop()
        if not open_spans:
            if is_inner:
                raise ValueError(
                    f"inner segment ({a}, {b}) lies inside no segment of {sorted(top)}; an inner segment is "
                    "recomputed within the recompute of the segment around it, so it must lie inside one. "
                    f"Add a segment around ({a}, {b}) or pass it as a segment."
                )
        else:
            (pa, pb), parent_inner = open_spans[-1]
            kind = "inner segment" if parent_inner else "segment"
            if (pa, pb) == (a, b):
                raise ValueError(
                    f"inner segment ({a}, {b}) equals the {kind} ({pa}, {pb}) around it; an inner segment must "
                    "lie strictly inside its parent (nesting a region in an identical one only recomputes it "
                    "twice). Drop the duplicate."
                )
            if b > pb:
                raise ValueError(
                    f"inner segment ({a}, {b}) crosses the {kind} ({pa}, {pb}): they share blocks {a}..{pb} but "
                    "neither contains the other, so the regions cannot nest. Nested segments must be disjoint "
                    "or one strictly inside the other; shrink or split one of them."
                )
        open_spans.append(((a, b), is_inner))
    return sorted(inner)


def direct_children(first: int, last: int, inner: Sequence[Span]) -> list[Span]:
    """The largest inner segments strictly inside [first, last], in order (validated `inner`)."""
    inside = sorted(((a, b) for a, b in inner if first <= a and b <= last and (a, b) != (first, last)), key=lambda s: (s[0], -s[1]))
    out: list[Span] = []
    for a, b in inside:
        if out and a <= out[-1][1]:
            continue  # inside the previous child
        out.append((a, b))
    return out


def inner_elements(first: int, last: int, inner: Sequence[Span]) -> list[tuple[int, int, bool]]:
    """The elements of the recompute of segment [first, last], left to right: `(a, b, True)`
    for a direct child, `(p, p, False)` for a block in no child (it saves in the recompute)."""
    out: list[tuple[int, int, bool]] = []
    kids = iter(direct_children(first, last, inner))
    nxt = next(kids, None)
    p = first
    while p <= last:
        if nxt is not None and nxt[0] == p:
            out.append((nxt[0], nxt[1], True))
            p = nxt[1] + 1
            nxt = next(kids, None)
        else:
            out.append((p, p, False))
            p += 1
    return out


def nested_backward(cost: StepCost, first: int, last: int, inner: Sequence[Span], terms, plain) -> tuple[int, int]:
    """The backward peak of segment [first, last] above the step's base bytes (`memory_model.base_bytes`)
    and the bytes resident before it, and the block where it is reached (the last of equal ones).

    [constraint] the recompute rebuilds, on top of the segment's input x (its first block's
    input, counted once with what that block saves when it saves it), the elements of
    `inner_elements` left to right: a block in no child adds what it saves (resident P), a
    child adds its input. The terms (`peak_terms`), each on top of x and the P before it:
      block p:  its backward on what it saved (`kept_backward_bytes`)
      child c:  the child's own backward (this function, or a plain segment's), and, when
                something after it is saved, its forward inside the recompute
                (`child_forward_bytes`)
      end:      the recompute's forward scratch (the largest of the blocks in no child) as the
                last block's backward begins, on P_all (`recompute_end_bytes`)
    Neighbours share storages as at the top level (`memory_model.boundary_shift`): a block
    after a child also holds what it shares with the child's last block; a child after a
    block finds its input already resident when that block saved it. With no children
    this equals `memory_model.segment_elements`' backward.

    `terms` is `memory_model.step_terms(cost)`; `plain(a, b)` the plain segment's element
    (`memory_model.segment_elements`), whose backward a child without children has.
    """
    blocks = cost.blocks
    after = terms.gradients_after
    elements = inner_elements(first, last, inner)
    tail, tail_grads = blocks[last], after[last]
    resident = segment_activations_bytes(blocks[first], 0) if not elements[0][2] else 0
    best, at = -1, last
    scratch = 0
    prev_child: bool | None = None
    for j, (a, b, child) in enumerate(elements):
        if child:
            if prev_child is False:
                resident -= blocks[a].input_saved_by_previous_bytes
            if direct_children(a, b, inner):
                need, where = nested_backward(cost, a, b, inner, terms, plain)
            else:
                alone = plain(a, b)
                need, where = alone.backward_bytes - terms.base_bytes, alone.backward_block
            if resident + need >= best:
                best, at = resident + need, where
            if j < len(elements) - 1:
                fwd = child_forward_bytes(segment_inflight_bytes(blocks, a, b), tail, tail_grads)
                if resident + fwd >= best:
                    best, at = resident + fwd, b
            resident += blocks[a].input_bytes
        else:
            blk = blocks[a]
            if prev_child:
                resident += blk.shared_with_previous_bytes
            need = resident + kept_backward_bytes(blk, after[a], terms.grads_kept)
            if need >= best:
                best, at = need, a
            resident += blk.saved_bytes
            scratch = max(scratch, recompute_scratch_bytes(blk))
        prev_child = child
    end = recompute_end_bytes(tail, tail_grads, resident, scratch)
    if end >= best:
        best, at = end, last
    return best, at


def nested_segment_cost(
    cost: StepCost, first: int, last: int, inner: Sequence[Span], block_cost, tail_cost, overhead: float
) -> float:
    """What rebuilding segment [first, last] with its children costs, in the units of
    `block_cost(i)` (a block's forward) and `tail_cost(i)` (what early stop skips when it
    ends a recompute), plus `overhead` per checkpointed segment.

    [constraint] the recompute stops after the last tensor it must save (torch's early
    stop): after the last block's saved tensors when that block is in no child (its tail
    is skipped), at the last child's input otherwise (that child's blocks do not run in
    it). Each child then rebuilds itself once more, by the same rule.
    """
    elements = inner_elements(first, last, inner)
    a_last, _, child_last = elements[-1]
    if child_last:
        total = sum(block_cost(i) for i in range(first, a_last))
    else:
        total = sum(block_cost(i) for i in range(first, last + 1)) - tail_cost(last)
    total += overhead
    for a, b, child in elements:
        if child:
            total += nested_segment_cost(cost, a, b, inner, block_cost, tail_cost, overhead)
    return total


def depth_of(segments: Sequence[Span], inner: Sequence[Span]) -> int:
    """Levels of checkpointing: 0 without segments, 1 without inner segments, and so on."""
    if not segments:
        return 0

    def depth(a: int, b: int) -> int:
        return 1 + max((depth(c, d) for c, d in direct_children(a, b, inner)), default=0)

    return max(depth(a, b) for a, b in segments)


def recompute_counts(n_blocks: int, segments: Sequence[Span], inner: Sequence[Span]) -> list[int]:
    """How many times each block's forward runs again in the backward (`nested_segment_cost`'s
    rule, counting a block whose tail early stop skips as run): 0 kept, 1 in a plain segment."""
    runs = [0] * n_blocks

    def visit(a: int, b: int) -> None:
        elements = inner_elements(a, b, inner)
        end = elements[-1][0] if elements[-1][2] else b + 1
        for i in range(a, end):
            runs[i] += 1
        for c, d, child in elements:
            if child:
                visit(c, d)

    for a, b in segments:
        visit(a, b)
    return runs
