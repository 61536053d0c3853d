"""The terms of the memory model: what one block's forward and backward hold, on top of the
bytes resident before them, when it is kept, in a checkpointed segment or in a recompute.

Each term is one function that serves one block (`BlockCost`, ints) and all blocks at once
(`BlockColumns`, int64 columns), so the scalar elements (`memory_model`), their numpy form
(`element_arrays`), multi-level plans (`nested_model`, `nested_planner`) and the report's floor
add up the same terms. No term includes the step's base bytes (`memory_model.base_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from operator import attrgetter

import numpy as np

from lightning_ckpt.costs.block_costs import BlockCost


def _max(a, b):
    """The larger of two byte counts: ints, or numpy columns element by element."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return max(a, b)


@dataclass(frozen=True, eq=False)
class BlockColumns:
    """The `BlockCost` fields the terms read, as int64 columns over the blocks (same names).

    ckpt_fwd_peak_bytes holds `ckpt_forward_bytes` of each block: the measured peak, or its
    bound where it was not measured (None in `BlockCost`); kept_grads_bwd_transient_bytes the
    `backward_scratch_bytes` of a backward into kept gradients, the same way."""

    saved_bytes: np.ndarray
    input_bytes: np.ndarray
    input_saved_bytes: np.ndarray
    output_bytes: np.ndarray
    output_saved_bytes: np.ndarray
    input_unsaved_bytes: np.ndarray
    fwd_transient_bytes: np.ndarray
    stop_output_bytes: np.ndarray
    ckpt_fwd_peak_bytes: np.ndarray
    bwd_transient_bytes: np.ndarray
    kept_grads_bwd_transient_bytes: np.ndarray
    carried_fwd_bytes: np.ndarray
    carried_bwd_bytes: np.ndarray

    @classmethod
    def of(cls, blocks: Sequence[BlockCost]) -> BlockColumns:
        names = [f.name for f in fields(cls)]
        peak, kept = names.index("ckpt_fwd_peak_bytes"), names.index("kept_grads_bwd_transient_bytes")
        read = attrgetter(*names)
        rows = []
        for b in blocks:
            row = list(read(b))
            row[peak] = ckpt_forward_bytes(b)
            row[kept] = backward_scratch_bytes(b, True)
            rows.append(row)
        # one table, each column a contiguous row of its transpose (each value converted as one column would)
        table = np.array(rows, dtype=np.int64).reshape(len(blocks), len(names)).T.copy()
        return cls(*table)

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> BlockColumns:
        """The same columns, each passed through `fn` (a slice, or windows over the blocks)."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)})


# ----------------------------------------------------------------------------- state copies


def state_snapshot_bytes(blocks: Sequence[BlockCost]) -> int:
    """[constraint] A checkpointed block's copy of the module state its forward writes
    (`BlockCost.written_state_bytes`: BatchNorm statistics, spectral norm's vectors, QAT observers)
    lives from its forward to its recompute (`apply.state_guard`). Counted for every block, whatever
    the plan checkpoints: an upper bound by the copies of kept blocks, which keeps what a segment
    leaves resident independent of where it ends; 0 for a chain that writes no state."""
    return sum(b.written_state_bytes for b in blocks)


# ----------------------------------------------------------------------------- forward


def ckpt_forward_bytes(blk):
    """[constraint] What a block's forward needs above the bytes live at its entry when it
    saves nothing (inside a checkpointed segment): measured (`ckpt_fwd_peak_bytes`), or else
    bounded by what it would save and return plus its scratch, less the input it would save."""
    if isinstance(blk, BlockColumns) or blk.ckpt_fwd_peak_bytes is not None:
        return blk.ckpt_fwd_peak_bytes  # columns: this function's value per block (`BlockColumns.of`)
    return blk.saved_bytes - blk.input_saved_bytes + blk.output_bytes - blk.output_saved_bytes + blk.fwd_transient_bytes


def checkpointed_forward_bytes(blk):
    """A block's forward that saves nothing, above what was live before it: its input and
    what it makes in flight (`ckpt_forward_bytes`)."""
    return blk.input_bytes + ckpt_forward_bytes(blk)


def segment_inflight_bytes(blocks: Sequence[BlockCost], first: int, last: int) -> int:
    """[constraint] The peak of segment [first, last]'s forward when it saves nothing, above what
    was live before it: each block's `checkpointed_forward_bytes`, beside the segment's boundary
    from the second block on (as a segment's forward runs inside a recompute)."""
    x = blocks[first].input_bytes
    return max((x if b > first else 0) + checkpointed_forward_bytes(blocks[b]) for b in range(first, last + 1))


def segment_block_forward_bytes(blk, forward_grads, beside_bytes):
    """[constraint] A block's forward inside a checkpointed segment: the gradients allocated in
    the forward (`memory_model.forward_grad_bytes`), the segment's boundary beside it
    (`beside_bytes`: 0 for the segment's first block), its `checkpointed_forward_bytes` and the
    carried storages alive then."""
    return forward_grads + beside_bytes + checkpointed_forward_bytes(blk) + blk.carried_fwd_bytes


def gap_forward_bytes(left_bytes, forward_grads, gap_bytes):
    """[constraint] The modules outside the chain after an element (`gap_bytes`,
    `memory_model.gap_after`) run on what the element leaves resident (`left_bytes`), with the
    gradients allocated in the forward."""
    return forward_grads + left_bytes + gap_bytes


def kept_forward_bytes(blk, forward_grads, gap_bytes):
    """[constraint] A kept block's forward: what it saves, its output (less the part it saves),
    its scratch, the part of its input no block saves and the carried storages alive then, with
    the gradients allocated in the forward; or the gap after it, on what it saved less its output
    (which the gap's bytes hold)."""
    own = blk.saved_bytes + forward_grads + blk.output_bytes - blk.output_saved_bytes + blk.fwd_transient_bytes
    return _max(
        own + blk.input_unsaved_bytes + blk.carried_fwd_bytes,
        gap_forward_bytes(blk.saved_bytes - blk.output_saved_bytes, forward_grads, gap_bytes),
    )


def recompute_scratch_bytes(blk):
    """[constraint] What a block's forward holds in a recompute beyond what it saves: its forward
    scratch and, where the op that saves last made the block's output first, that output
    (`stop_output_bytes`): the recompute stops after that save (torch's early stop) with both alive."""
    return blk.fwd_transient_bytes + blk.stop_output_bytes


# ----------------------------------------------------------------------------- backward


def backward_scratch_bytes(blk, grads_kept):
    """[constraint] What a block's own backward makes above the bytes live at its start, its parameter
    gradients included. With `.grad` unset each gradient it makes stays (`bwd_transient_bytes`); with the
    gradients kept from an earlier micro-batch (`StepCost.grads_accumulate`, all of them counted in
    `grads_after`) autograd adds each new one into `.grad` in place and frees it, so only those made and
    not yet added count (`kept_grads_bwd_transient_bytes`, or the unset peak where it was not measured)."""
    if not grads_kept:
        return blk.bwd_transient_bytes
    if isinstance(blk, BlockColumns) or blk.kept_grads_bwd_transient_bytes is not None:
        return blk.kept_grads_bwd_transient_bytes  # columns: this function's value per block (`BlockColumns.of`)
    return blk.bwd_transient_bytes


def backward_held_bytes(blk, grads_after):
    """What a block's backward holds besides activations and scratch: the parameter gradients
    that exist then (`grads_after`, `memory_model.gradients_after`), the gradient of its output
    and the carried storages alive then."""
    return grads_after + blk.output_bytes + blk.carried_bwd_bytes


def block_backward_bytes(blk, grads_after, activations_bytes, scratch_bytes=0, grads_kept=False):
    """[constraint] A block's backward: the activations that exist then (`activations_bytes`:
    what it saved, or all a segment's recompute rebuilt up to it), `backward_held_bytes`, and the
    larger of its own scratch (`backward_scratch_bytes`; `grads_kept`: into kept gradients) and the
    forward scratch of a recompute still alive then (`scratch_bytes`: the last block of a segment meets it)."""
    own = backward_scratch_bytes(blk, grads_kept)
    return activations_bytes + backward_held_bytes(blk, grads_after) + _max(own, scratch_bytes)


def kept_backward_bytes(blk, grads_after, grads_kept=False):
    """[constraint] A kept block's backward, on what it saved. Also the least any block's backward
    needs under any plan, whatever the nesting: what it saved exists again however it was
    rebuilt (`memory_model.peak_floor_bytes`)."""
    return block_backward_bytes(blk, grads_after, blk.saved_bytes, grads_kept=grads_kept)


def segment_activations_bytes(first_blk, rebuilt_bytes):
    """The activations a segment's backward holds: its boundary (the input of its first block
    `first_blk`, counted once with the part that block saves) and `rebuilt_bytes`, what its
    recompute saved."""
    return first_blk.input_bytes - first_blk.input_saved_bytes + rebuilt_bytes


def recompute_end_bytes(last_blk, grads_after, activations_bytes, scratch_bytes):
    """[constraint] The end of a recompute of a segment ending at `last_blk`: the recompute's
    forward scratch (`scratch_bytes`) still alive as that block's backward begins, on the
    activations rebuilt and what that backward holds (`backward_held_bytes`)."""
    return activations_bytes + backward_held_bytes(last_blk, grads_after) + scratch_bytes


def child_forward_bytes(inflight_bytes, parent_last, grads_after_last):
    """[constraint] An inner segment's forward inside its parent's recompute: its
    `segment_inflight_bytes`, with what the backward of the parent's last block holds (the
    recompute runs as that backward begins) in place of the forward's gradients."""
    return inflight_bytes + backward_held_bytes(parent_last, grads_after_last)
