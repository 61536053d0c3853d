"""Predicted peak memory of one training step under a checkpointing plan: the one
definition of the peak, used by every policy, by the exact chain planner and by the plan.

A plan is a list of segments `(first, last)` of consecutive checkpointed blocks;
every other block is kept. Read left to right, a plan is a sequence of *elements*
("keep block p", "checkpoint segment [a, b]"), each with what it needs on top of the
bytes R_e the elements before it leave resident, and the peak is

    peak = max(opt_need, R_n + end_need - relief, max_e (R_e + need_e + shift_e))

A block checkpointed alone may keep some op outputs (op-level plans, `op_options`):
its element is the one-block segment's with the kept bytes resident and in its forward
(`selective_element`). The whole step is in the terms: what modules outside the chain
hold and what outlives its neighbour edge (`gap_after`, the `carried_*` fields).
Each block's part of an element is a term of `peak_terms`; `predict_peak` adds them up for one
plan, `element_arrays` for the planners (numpy columns). See docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.nested_model import direct_children, nested_backward
from lightning_ckpt.planning.op_options import Keeps, kept_bytes
from lightning_ckpt.planning.peak_terms import (
    block_backward_bytes,
    gap_forward_bytes,
    kept_backward_bytes,
    kept_forward_bytes,
    recompute_scratch_bytes,
    segment_activations_bytes,
    segment_block_forward_bytes,
    state_snapshot_bytes,
)

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


# ----------------------------------------------------------------------------- step-wide terms


def base_bytes(cost: StepCost) -> int:
    """Resident under every element: parameters, buffers, optimizer state, the batch, the
    activations saved before the first block and the copies of written module state
    (`state_snapshot_bytes`)."""
    return cost.static_bytes + cost.batch_bytes + cost.pre_saved_bytes + state_snapshot_bytes(cost.blocks)


def forward_grad_bytes(cost: StepCost) -> int:
    """The parameter gradients allocated during the forward: last step's, when they are
    still allocated (`grads_live_in_forward`), or those earlier micro-batches accumulated
    (`grads_accumulate`); none when gradients leave the device (`grads_on_device`)."""
    return cost.device_grad_bytes if cost.grads_live_in_forward or cost.grads_accumulate else 0


def gradients_after(cost: StepCost) -> list[int]:
    """Per block, the parameter gradients that exist during its backward: those the head's
    backward made (it runs first), those of every later block and of the modules outside
    the chain after it (`gap_grad_bytes`); all of them when the step accumulates into
    gradients earlier micro-batches made. The new gradient autograd holds until it adds it
    into `.grad` (in place) is in the block's own scratch, `peak_terms.backward_scratch_bytes`. None when
    gradients leave the device as they are made (`grads_on_device`): a block's own are in its scratch."""
    if not cost.grads_on_device:
        return [0] * cost.n_blocks
    if cost.grads_accumulate:
        return [cost.grad_bytes] * cost.n_blocks
    after = [0] * cost.n_blocks
    acc = cost.head_outside_grad_bytes
    for i in range(cost.n_blocks - 1, -1, -1):
        after[i] = acc
        acc += cost.blocks[i].grad_bytes + cost.blocks[i].gap_grad_bytes
    return after


def head_grad_bytes(cost: StepCost) -> int:
    """The parameter gradients that exist during the head's backward: those it makes, or all
    of them when the step accumulates, none when they leave the device (`gradients_after`)."""
    if not cost.grads_on_device:
        return 0
    return cost.grad_bytes if cost.grads_accumulate else cost.head_outside_grad_bytes


@dataclass(frozen=True)
class StepTerms:
    """The step-wide terms every element needs, computed once per cost (`step_terms`)."""

    base_bytes: int
    forward_grad_bytes: int
    gradients_after: tuple[int, ...]
    grads_kept: bool  # the backward adds into gradients an earlier micro-batch made (`backward_scratch_bytes`)


# (cost, its `StepTerms`, its kept elements or None) for the last cost asked: the planners ask for the same
# cost's terms again and again (the exact planner's test for keeping every block, then that plan's peak;
# greedy's and every_k's peaks), and a `StepCost` is frozen, blocks and all, so the cost itself names them
_LAST: tuple = (None, None, None)


def step_terms(cost: StepCost) -> StepTerms:
    global _LAST
    last = _LAST
    if last[0] is not cost:
        terms = StepTerms(base_bytes(cost), forward_grad_bytes(cost), tuple(gradients_after(cost)), cost.grads_accumulate)
        last = _LAST = (cost, terms, None)
    return last[1]


def kept_elements(cost: StepCost) -> tuple[Element, ...]:
    """`kept_element` of every block."""
    global _LAST
    terms = step_terms(cost)
    last = _LAST
    if last[0] is not cost or last[2] is None:
        last = _LAST = (cost, terms, tuple(kept_element(cost, p, terms) for p in range(cost.n_blocks)))
    return last[2]


def post_forward(cost: StepCost) -> int:
    """The peak after the last block during the forward (the head and the loss)."""
    return cost.post_saved_bytes if cost.post_forward_bytes is None else cost.post_forward_bytes


def end_need(cost: StepCost) -> int:
    """[constraint] The end of the forward and the head's backward, on top of what the
    blocks leave resident: the forward with last step's gradients still allocated (when they
    are), the head's backward with the gradients it makes (all of them when the step
    accumulates), both with the carried storages alive then."""
    terms = step_terms(cost)  # the planners ask for the kept elements of the same cost next
    head = max(post_forward(cost) + terms.forward_grad_bytes, cost.post_saved_bytes + head_grad_bytes(cost))
    return terms.base_bytes + head + cost.carried_end_bytes


def end_relief(cost: StepCost, last_kept: bool) -> int:
    """[constraint] The head runs on the last block's output: already resident (not
    counted again in `end_need`) when that block is kept and saved it."""
    return cost.blocks[-1].output_saved_bytes if cost.n_blocks and last_kept else 0


def optimizer_need(cost: StepCost) -> int:
    """The optimizer step: parameters and state, all gradients, the optimizer's scratch (and the
    batch, which the training loop holds until the step ends); the gradients only when they stay on the device."""
    return cost.static_bytes + cost.batch_bytes + cost.device_grad_bytes + cost.optimizer_transient_bytes


def peak_floor_bytes(cost: StepCost) -> int:
    """[bound] No plan peaks below this, whatever its nesting: the optimizer step, the end of the
    forward and the head's backward, and each block's backward with what it saves rebuilt
    (`kept_backward_bytes`), on the base bytes."""
    after = gradients_after(cost)
    kept = cost.grads_accumulate
    blocks = [base_bytes(cost) + kept_backward_bytes(b, after[i], kept) for i, b in enumerate(cost.blocks)]
    # the head on a kept last block finds the output it saved resident (`end_relief`); what the
    # block leaves resident holds all it saved, so at most the part of the relief beyond that is off
    last = cost.blocks[-1] if cost.n_blocks else None
    relief = max(0, last.output_saved_bytes - last.saved_bytes) if last is not None else 0
    return max([optimizer_need(cost), end_need(cost) - relief, *blocks])


# ----------------------------------------------------------------------------- elements


class Element(NamedTuple):
    """One element of a plan: kept block `first` (== `last`) or checkpointed segment [first, last].

    forward_bytes, backward_bytes: the peak of its forward and of its backward on top of
        R_e, the bytes the elements before it leave resident (`base_bytes` included; the
        backward with the gradients of the blocks after it). Both before `boundary_shift`.
    backward_block: the block where `backward_bytes` is reached (the last of equal ones).
    resident_bytes: what it leaves resident for later blocks, before `boundary_shift`.
    """

    first: int
    last: int
    checkpointed: bool
    forward_bytes: int
    backward_bytes: int
    backward_block: int
    resident_bytes: int

    @property
    def need_bytes(self) -> int:  # need_e: the element's own peak on top of R_e
        return max(self.forward_bytes, self.backward_bytes)


def boundary_shift(cost: StepCost, first: int, checkpointed: bool, after_kept: bool) -> int:
    """The correction to the need and the resident bytes of the element starting at
    block `first`, for storages it shares with the block before (`after_kept`: that
    block is kept). A storage two neighbours save counts once, with the first saver.

    [constraint] a kept block after a checkpointed one also holds what it shares with
    that block (`shared_with_previous_bytes`: no longer resident on the other's
    account); a segment after a kept block finds its boundary already resident when
    that block saved it (`input_saved_by_previous_bytes`). Zero everywhere else, and
    at block 0, which has no block before it.
    """
    if first == 0:
        return 0
    blk = cost.blocks[first]
    if checkpointed:
        return -blk.input_saved_by_previous_bytes if after_kept else 0
    return 0 if after_kept else blk.shared_with_previous_bytes


def boundary_shifts(cost: StepCost, segments: Segments) -> list[int]:
    """Per block, the `boundary_shift` of the element starting there (0 inside a segment)."""
    n = cost.n_blocks
    owner = segment_of(n, segments)
    shift = [0] * n
    for i in range(n):
        ckpt = owner[i] >= 0
        if not ckpt or segments[owner[i]][0] == i:
            shift[i] = boundary_shift(cost, i, ckpt, i > 0 and owner[i - 1] < 0)
    return shift


def gap_after(cost: StepCost, last: int) -> int:
    """[constraint] The modules outside the chain between block `last` and the next one run
    on top of what the element ending at `last` leaves resident (`BlockCost.gap_fwd_bytes`)."""
    return cost.blocks[last + 1].gap_fwd_bytes if last + 1 < cost.n_blocks else 0


def kept_element(cost: StepCost, p: int, terms: StepTerms) -> Element:
    """Block `p` kept (`terms` = `step_terms(cost)`).

    [constraint] it leaves what it saved resident; its forward is `kept_forward_bytes` (the
    gap after it included), its backward `kept_backward_bytes`, both on the base bytes.
    """
    blk = cost.blocks[p]
    fwd = terms.base_bytes + kept_forward_bytes(blk, terms.forward_grad_bytes, gap_after(cost, p))
    bwd = terms.base_bytes + kept_backward_bytes(blk, terms.gradients_after[p], terms.grads_kept)
    return Element(p, p, False, fwd, bwd, p, blk.saved_bytes)


def segment_elements(cost: StepCost, first: int, terms: StepTerms) -> Iterator[Element]:
    """The checkpointed segments [first, b] for b = first, first + 1, ... to the last
    block, each in O(1) from the one before (`terms` = `step_terms(cost)`).
    Chaining is not checked here: it decides which plans are valid, not their peak.

    [constraint] a segment leaves only its boundary (its first block's input) resident.
    Its forward saves nothing: block b's is `segment_block_forward_bytes`, from the second
    block on beside the boundary; the gap after block b runs on the boundary. Its backward
    rebuilds the interior at once (`segment_activations_bytes`); block k < b runs its
    backward with blocks first..k rebuilt, the last block's also meets the recompute's
    forward scratch (`block_backward_bytes`).
    """
    blocks = cost.blocks
    after, kept = terms.gradients_after, terms.grads_kept
    base, fwd_grads = terms.base_bytes, terms.forward_grad_bytes
    x = blocks[first].input_bytes
    fwd = rebuilt = scratch = 0
    inner, inner_at = None, first  # the largest backward of a block before b, and its block
    for b in range(first, len(blocks)):
        blk = blocks[b]
        fwd = max(fwd, base + segment_block_forward_bytes(blk, fwd_grads, x if b > first else 0))
        rebuilt += blk.saved_bytes
        scratch = max(scratch, recompute_scratch_bytes(blk))
        acts = segment_activations_bytes(blocks[first], rebuilt)
        last = base + block_backward_bytes(blk, after[b], acts, scratch, kept)
        out = max(fwd, base + gap_forward_bytes(x, fwd_grads, gap_after(cost, b)))
        if inner is None or last >= inner:
            yield Element(first, b, True, out, last, b, x)
        else:
            yield Element(first, b, True, out, inner, inner_at, x)
        alone = base + block_backward_bytes(blk, after[b], acts, grads_kept=kept)
        if inner is None or alone >= inner:
            inner, inner_at = alone, b


def selective_element(segment: Element, keep_bytes: int) -> Element:
    """A block checkpointed alone that keeps `keep_bytes` of its op outputs (`op_options`),
    from its one-block `segment` element.

    [constraint] it leaves its boundary and the kept outputs resident; its forward holds
    the kept outputs on top of a checkpointed forward; its backward is the segment's: the
    recompute rebuilds the rest, so all it saves exists again at once, as without keeping.
    """
    return segment._replace(
        forward_bytes=segment.forward_bytes + keep_bytes, resident_bytes=segment.resident_bytes + keep_bytes
    )


def plan_elements(
    cost: StepCost, segments: Segments, keeps: Keeps | None = None, inner: Segments = ()
) -> Iterator[tuple[Element, int]]:
    """The elements of a plan (validated `segments`; `keeps` validated by
    `op_options.validate_keeps`; `inner` segments by `nested_model.validate_nested`) left
    to right, with their `boundary_shift`. A segment with inner segments inside has the
    backward of `nested_model.nested_backward`."""
    terms = step_terms(cost)

    def plain(a: int, b: int) -> Element:
        return next(e for e in segment_elements(cost, a, terms) if e.last == b)

    starts = {a: b for a, b in segments}
    keeps = keeps or {}
    i, kept_before, n = 0, False, cost.n_blocks
    kept = kept_elements(cost) if len(starts) < n else ()
    while i < n:
        if i in starts:
            el = next(e for e in segment_elements(cost, i, terms) if e.last == starts[i])
            if keeps.get(i):
                el = selective_element(el, kept_bytes(cost.blocks[i], keeps[i]))
            elif inner and direct_children(i, starts[i], inner):
                need, at = nested_backward(cost, i, starts[i], inner, terms, plain)
                el = el._replace(backward_bytes=terms.base_bytes + need, backward_block=at)
        else:
            el = kept[i]
        yield el, boundary_shift(cost, i, el.checkpointed, kept_before)
        i, kept_before = el.last + 1, not el.checkpointed


def predict_peak(cost: StepCost, segments: Segments, keeps: Keeps | None = None, inner: Segments = ()) -> PeakBreakdown:
    """Peak bytes of a whole training step under `segments` (already validated), the op
    outputs `keeps` keeps in blocks checkpointed alone (`selective_element`), and the
    `inner` segments rebuilt inside the recompute of those around them (`nested_model`), by phase.

    [recurrence] the elements left to right, R_e summing what those before e leave
    resident (shifts included):
      forward   = max(R_n + end_need - relief, max_e (R_e + shift_e + forward_e))
                  (the end of the forward and the head's backward count as forward),
      backward  = max_e (R_e + shift_e + backward_e), block by block from the last,
      optimizer = opt_need;
    the peak is the largest, its phase the first of forward, optimizer, backward:<block>
    that reaches it (for backward, the last block of equal ones).
    """
    resident = 0
    fwd, bwd, bwd_at = 0, step_terms(cost).base_bytes, -1
    kept_last = False
    # no segment: every element a kept block, none after a checkpointed one (each `boundary_shift` 0)
    elements = plan_elements(cost, segments, keeps, inner) if segments else ((el, 0) for el in kept_elements(cost))
    for el, shift in elements:
        fwd = max(fwd, resident + shift + el.forward_bytes)
        if resident + shift + el.backward_bytes >= bwd:
            bwd, bwd_at = resident + shift + el.backward_bytes, el.backward_block
        resident += el.resident_bytes + shift
        kept_last = not el.checkpointed
    fwd = max(fwd, resident + end_need(cost) - end_relief(cost, kept_last))
    opt = optimizer_need(cost)
    peak = max(fwd, bwd, opt)
    phase = "forward" if peak == fwd else ("optimizer" if peak == opt else f"backward:{cost.blocks[bwd_at].name}")
    return PeakBreakdown(int(peak), phase, int(fwd), int(bwd), int(opt))
