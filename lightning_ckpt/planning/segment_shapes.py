"""Segments of a fixed shape, whatever the budget: every k blocks (`every_k`), about sqrt(n) blocks
(`sqrt`), runs of chosen blocks; and segments split where a block does not take the previous
block's output (a segment must be a chain) or around a block that must stay kept (its forward
writes Python state a recompute cannot replay).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_ckpt.costs.block_costs import StepCost


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


def chainable(cost: StepCost, segments: Sequence[tuple[int, int]]) -> bool:
    return all(cost.blocks[i].chains_from_previous for a, b in segments for i in range(a + 1, b + 1))


def _split_at_breaks(cost: StepCost, segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
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


def must_keep(cost: StepCost) -> tuple[int, ...]:
    """Blocks no segment may hold: their forward writes Python state a recompute cannot replay
    (`BlockCost.unreplayable`)."""
    return tuple(i for i, b in enumerate(cost.blocks) if b.unreplayable)


def split_unchainable(cost: StepCost, segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Cut segments where a block does not take the previous block's output, and leave out the
    blocks that must stay kept (`must_keep`)."""
    out = []
    for a, b in _split_at_breaks(cost, segments):
        start = a
        for i in range(a, b + 1):
            if cost.blocks[i].unreplayable:
                if start < i:
                    out.append((start, i - 1))
                start = i + 1
        if start <= b:
            out.append((start, b))
    return out


def kept_blocks_in(cost: StepCost, segments: Sequence[tuple[int, int]]) -> list[int]:
    """The must-keep blocks (`must_keep`) that `segments` put in a segment."""
    return [i for a, b in segments for i in range(a, b + 1) if cost.blocks[i].unreplayable]


def kept_phrase(cost: StepCost, indices: Sequence[int]) -> str:
    """Each must-keep block with what its forward writes, for messages."""
    return "; ".join(f"block {i} {cost.blocks[i].name!r} ({', '.join(cost.blocks[i].unreplayable)})" for i in indices)
