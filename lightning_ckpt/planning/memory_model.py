"""Predicted peak memory of one training step under a checkpointing plan.

A plan is a list of segments `(first, last)` of consecutive checkpointed blocks;
every other block is kept. The step is walked phase by phase (forward, backward
block by block from the last, optimizer step) and the peak is the largest total.
The `k + n/k` rule of the square-root argument is the uniform special case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_ckpt.planning.costs import StepCost, ckpt_forward_bytes

Segments = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class PeakBreakdown:
    peak_bytes: int
    phase: str  # where the peak happens: "forward", "backward:<block>", "optimizer"
    forward_bytes: int
    backward_bytes: int
    optimizer_bytes: int


def validate_segments(n_blocks: int, segments: Segments) -> list[tuple[int, int]]:
    """Sorted, disjoint, in-range segments or a ValueError saying which is wrong."""
    out = sorted((int(a), int(b)) for a, b in segments)
    prev_last = -1
    for a, b in out:
        if not (0 <= a <= b < n_blocks):
            raise ValueError(
                f"segment ({a}, {b}) is outside the chain of {n_blocks} blocks; a segment is "
                f"(first, last) with 0 <= first <= last <= {n_blocks - 1}."
            )
        if a <= prev_last:
            raise ValueError(f"segment ({a}, {b}) overlaps the previous segment ending at {prev_last}; segments must be disjoint.")
        prev_last = b
    return out


def segment_of(n_blocks: int, segments: Segments) -> list[int]:
    """For each block, the index of its segment, or -1 when the block is kept."""
    owner = [-1] * n_blocks
    for j, (a, b) in enumerate(segments):
        for i in range(a, b + 1):
            owner[i] = j
    return owner


def boundary_shifts(cost: StepCost, segments: Segments) -> list[int]:
    """Per block, the correction to the first block of a plan element for storages
    that two neighbouring blocks both save (counted once, with the first saver).

    [constraint] a kept block after a checkpointed one also holds what it shares with
    that block (`shared_with_previous_bytes`: no longer resident on the other's
    account); a segment after a kept block finds its boundary already resident when
    that block saved it (`input_saved_by_previous_bytes`). Zero everywhere else.
    """
    n = len(cost.blocks)
    owner = segment_of(n, segments)
    shift = [0] * n
    for i in range(1, n):
        prev_kept = owner[i - 1] < 0
        if owner[i] < 0 and not prev_kept:
            shift[i] = cost.blocks[i].shared_with_previous_bytes
        elif owner[i] >= 0 and segments[owner[i]][0] == i and prev_kept:
            shift[i] = -cost.blocks[i].input_saved_by_previous_bytes
    return shift


def resident_bytes(cost: StepCost, segments: Segments) -> list[int]:
    """What each block leaves resident at the end of the forward.

    [constraint] a kept block holds what it saved; a segment holds only the input of
    its first block (the boundary tensor the recompute restarts from); both adjusted
    by `boundary_shifts` for storages shared with the block before.
    """
    res = [b.saved_bytes for b in cost.blocks]
    for a, b in segments:
        for i in range(a, b + 1):
            res[i] = 0
        res[a] = cost.blocks[a].input_bytes
    return [r + s for r, s in zip(res, boundary_shifts(cost, segments))]


def predict_peak(cost: StepCost, segments: Segments) -> PeakBreakdown:
    """Peak bytes of a whole training step under `segments` (already validated)."""
    blocks = cost.blocks
    n = len(blocks)
    shift = boundary_shifts(cost, segments)
    res = resident_bytes(cost, segments)
    prefix = [0] * (n + 1)
    for i in range(n):
        prefix[i + 1] = prefix[i] + res[i]
    static = cost.static_bytes + cost.pre_saved_bytes
    grads_all = cost.grad_bytes
    owner = segment_of(n, segments)

    # [forward] every block's resident bytes plus the head, with last step's grads
    # still allocated; during block i its own scratch is live as well. The first
    # block of a segment runs on top of its boundary input (unless already resident).
    fwd_grads = grads_all if cost.grads_live_in_forward else 0
    # [constraint] the head runs on the last block's output: already resident when
    # that block is kept and saved it.
    relief = blocks[-1].output_saved_bytes if n and owner[-1] < 0 else 0
    post = cost.post_saved_bytes - relief
    fwd = prefix[n] + post_forward(cost) - relief
    for i, blk in enumerate(blocks):
        if owner[i] < 0:
            own = blk.saved_bytes + blk.output_bytes - blk.output_saved_bytes + blk.fwd_transient_bytes + shift[i]
        else:
            # [constraint] a checkpointed block's forward saves nothing: on top of what is
            # resident (the segment's boundary from its second block on) it holds its
            # input and what it makes in flight
            own = blk.input_bytes + ckpt_forward_bytes(blk)
            if segments[owner[i]][0] == i:
                own += shift[i]
        fwd = max(fwd, prefix[i] + own)
    fwd += static + fwd_grads
    # The head's backward runs before any block gradient exists.
    fwd = max(fwd, static + cost.outside_grad_bytes + prefix[n] + post)

    # [backward] walk blocks from last to first; gradients of later blocks exist.
    grads_after = cost.outside_grad_bytes
    bwd, bwd_at = 0, -1
    i = n - 1
    while i >= 0:
        j = owner[i]
        if j < 0:
            blk = blocks[i]
            live = prefix[i] + blk.saved_bytes + shift[i] + blk.output_bytes + blk.bwd_transient_bytes
            if live + grads_after > bwd:
                bwd, bwd_at = live + grads_after, i
            grads_after += blk.grad_bytes
            i -= 1
            continue
        a, b = segments[j]
        # [recurrence] the segment's interior is rebuilt at once on top of what the
        # blocks before it hold; the boundary input is not counted twice.
        rebuilt = sum(blocks[k].saved_bytes for k in range(a, b + 1)) - blocks[a].input_saved_bytes
        base = prefix[a] + blocks[a].input_bytes + shift[a]
        scratch = max(blocks[k].fwd_transient_bytes for k in range(a, b + 1))
        for k in range(b, a - 1, -1):
            blk = blocks[k]
            extra = max(blk.bwd_transient_bytes, scratch) if k == b else blk.bwd_transient_bytes
            live = base + rebuilt + blk.output_bytes + extra
            if live + grads_after > bwd:
                bwd, bwd_at = live + grads_after, k
            rebuilt -= blk.saved_bytes - (blk.input_saved_bytes if k == a else 0)
            grads_after += blk.grad_bytes
        i = a - 1
    bwd += static

    # [optimizer] all gradients plus the optimizer's scratch.
    opt = cost.static_bytes + grads_all + cost.optimizer_transient_bytes

    peak = max(fwd, bwd, opt)
    phase = "forward" if peak == fwd else ("optimizer" if peak == opt else f"backward:{blocks[bwd_at].name}")
    return PeakBreakdown(int(peak), phase, int(fwd), int(bwd), int(opt))


def post_forward(cost: StepCost) -> int:
    """The peak after the last block during the forward (the head and the loss)."""
    return cost.post_saved_bytes if cost.post_forward_bytes is None else cost.post_forward_bytes


def end_need(cost: StepCost) -> int:
    """[constraint] The end of the forward and the head's backward, on top of what the
    blocks leave resident: the forward with last step's gradients still allocated
    (when they are), the head's backward with only the gradients outside the blocks."""
    static = cost.static_bytes + cost.pre_saved_bytes
    fwd_grads = cost.grad_bytes if cost.grads_live_in_forward else 0
    return static + max(post_forward(cost) + fwd_grads, cost.post_saved_bytes + cost.outside_grad_bytes)
