"""The element form of `memory_model` as int64 columns over the blocks, for the planners
(`chain_planner` through `chain_arrays`, `nested_planner`): the terms of `peak_terms` called on
all blocks at once (`BlockColumns`), or on windows of them for every segment of a block of
starts, and assembled as `memory_model.kept_element` and `segment_elements` assemble them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.memory_model import (
    base_bytes,
    end_need,
    end_relief,
    forward_grad_bytes,
    gradients_after,
    head_grad_bytes,
    optimizer_need,
)
from lightning_ckpt.planning.peak_terms import (
    BlockColumns,
    backward_held_bytes,
    block_backward_bytes,
    gap_forward_bytes,
    kept_backward_bytes,
    kept_forward_bytes,
    recompute_scratch_bytes,
    segment_activations_bytes,
    segment_block_forward_bytes,
)


@dataclass
class ElementArrays:
    """The element form as int64 columns over the blocks.

    keep_need[p] is `kept_element(p).need_bytes`; `segment_need_rows` gives
    `need_bytes` of every segment; the resident bytes are `saved` (kept) and `x` (a
    segment's boundary). sh[p] and -o[p] are the `boundary_shift` of a kept block after
    a checkpointed one and of a segment after a kept block (both 0 at p = 0);
    o[n] is `end_relief` with the last block kept (the end acts as a segment start
    whose boundary is the last block's output).
    """

    n: int
    static: int  # base_bytes
    fwd_grads: int  # forward_grad_bytes
    least_bwd_grads: int  # the gradients alive during every block's backward (the least of G)
    grads_kept: bool  # the backward adds into gradients an earlier micro-batch made (`backward_scratch_bytes`)
    end_need: int
    opt_need: int
    blocks: BlockColumns  # what the terms read
    G: np.ndarray  # gradients_after
    saved: np.ndarray  # saved_bytes
    x: np.ndarray  # input_bytes
    xs: np.ndarray  # input_saved_bytes
    sh: np.ndarray  # shared_with_previous_bytes (n + 1, 0 at 0 and n)
    o: np.ndarray  # input_saved_by_previous_bytes (n + 1, 0 at 0, end relief at n)
    gap: np.ndarray  # the gap after each block (`memory_model.gap_after`)
    W: np.ndarray  # prefix sums of saved (n + 1)
    v: np.ndarray  # backward_held_bytes + W[b+1]: block b's backward in a segment, less its scratch and the segment's base
    keep_need: np.ndarray


def element_arrays(cost: StepCost) -> ElementArrays:
    """The columns of `ElementArrays` for `cost` (the same terms as the scalar form)."""
    blocks = cost.blocks
    n = len(blocks)
    i64 = np.int64
    cols = BlockColumns.of(blocks)

    def col(name):
        return np.array([getattr(b, name) for b in blocks], dtype=i64).reshape(n)

    gap = np.concatenate((col("gap_fwd_bytes")[1:], np.zeros(min(n, 1), dtype=i64)))
    G = np.array(gradients_after(cost), dtype=i64).reshape(n)
    sh = np.concatenate((col("shared_with_previous_bytes"), np.zeros(1, dtype=i64)))
    o = np.concatenate((col("input_saved_by_previous_bytes"), np.zeros(1, dtype=i64)))
    sh[0] = o[0] = 0  # nothing before block 0
    o[n] = end_relief(cost, True)
    W = np.zeros(n + 1, dtype=i64)
    np.cumsum(cols.saved_bytes, out=W[1:])
    static, fwd_grads, kept = base_bytes(cost), forward_grad_bytes(cost), cost.grads_accumulate
    return ElementArrays(
        n=n,
        static=static,
        fwd_grads=fwd_grads,
        least_bwd_grads=int(G.min()) if n else head_grad_bytes(cost),
        grads_kept=kept,
        end_need=end_need(cost),
        opt_need=optimizer_need(cost),
        blocks=cols,
        G=G,
        saved=cols.saved_bytes,
        x=cols.input_bytes,
        xs=cols.input_saved_bytes,
        sh=sh,
        o=o,
        gap=gap,
        W=W,
        v=backward_held_bytes(cols, G) + W[1:],
        # [constraint] `kept_element`: its forward (or the gap after it) or its backward
        keep_need=static + np.maximum(kept_forward_bytes(cols, fwd_grads, gap), kept_backward_bytes(cols, G, kept)),
    )


def segment_need_rows(a: ElementArrays, p0: int, p1: int, width: int) -> np.ndarray:
    """need(p, p + t) of `segment_elements` for p in [p0, p1) (rows) and t < width
    (columns; where p + t is past the last block the values are meaningless)."""
    pad = np.zeros(width, dtype=np.int64)

    def win(arr):  # row r, column t: block p0 + r + t (a read-only view)
        ext = np.concatenate((arr[p0 : min(p1 + width, a.n)], pad))
        return as_strided(ext, shape=(p1 - p0, width), strides=(ext.strides[0],) * 2, writeable=False)

    rows = slice(p0, p1)
    blk = a.blocks.map(win)
    first = a.blocks.map(lambda c: c[rows, None])  # each row's first block
    x = a.x[rows, None]
    # [constraint] forward without saving: from the second block on beside the boundary
    fwd = segment_block_forward_bytes(blk, a.fwd_grads, x)
    fwd[:, :1] = segment_block_forward_bytes(first, a.fwd_grads, 0)
    np.maximum.accumulate(fwd, axis=1, out=fwd)
    np.maximum(fwd, gap_forward_bytes(x, a.fwd_grads, win(a.gap)), out=fwd)  # the gap after the segment
    # [constraint] backward: the interior is rebuilt at once on top of the boundary; the
    # last block's backward also meets the recompute's forward scratch; block k < b runs
    # its backward with blocks p..k still rebuilt.
    G = win(a.G)
    acts = segment_activations_bytes(first, win(a.W[1:]) - a.W[rows, None])
    kept = a.grads_kept
    last = block_backward_bytes(blk, G, acts, np.maximum.accumulate(recompute_scratch_bytes(blk), axis=1), kept)
    if width > 1:
        inner = np.maximum.accumulate(block_backward_bytes(blk, G, acts, grads_kept=kept), axis=1)
        np.maximum(last[:, 1:], inner[:, :-1], out=last[:, 1:])
    np.maximum(fwd, last, out=fwd)
    fwd += a.static
    return fwd


def single_segment_parts(a: ElementArrays) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward bytes of every one-block segment [p, p] (`segment_elements`),
    apart: a selective block adds its kept bytes to the forward only (`selective_element`)."""
    cols = a.blocks
    fwd = a.static + np.maximum(segment_block_forward_bytes(cols, a.fwd_grads, 0), gap_forward_bytes(a.x, a.fwd_grads, a.gap))
    acts = segment_activations_bytes(cols, cols.saved_bytes)
    bwd = a.static + block_backward_bytes(cols, a.G, acts, recompute_scratch_bytes(cols), a.grads_kept)
    return fwd, bwd
