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
`predict_peak` evaluates it (scalar form); `element_arrays` and `segment_need_rows` hold
the same terms as numpy columns for `chain_planner`. See docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from lightning_ckpt.costs.block_costs import StepCost, ckpt_forward_bytes
from lightning_ckpt.planning.nested_model import direct_children, nested_backward
from lightning_ckpt.planning.op_options import Keeps, kept_bytes

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
    """Resident under every element: parameters, buffers, optimizer state, the batch and
    the activations saved before the first block."""
    return cost.static_bytes + cost.batch_bytes + cost.pre_saved_bytes


def forward_grad_bytes(cost: StepCost) -> int:
    """The parameter gradients allocated during the forward: last step's, when they are
    still allocated (`grads_live_in_forward`), or those earlier micro-batches accumulated
    (`grads_accumulate`)."""
    return cost.grad_bytes if cost.grads_live_in_forward or cost.grads_accumulate else 0


def gradients_after(cost: StepCost) -> list[int]:
    """Per block, the parameter gradients that exist during its backward: those the head's
    backward made (it runs first), those of every later block and of the modules outside
    the chain after it (`gap_grad_bytes`); all of them when the step accumulates into
    gradients earlier micro-batches made."""
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
    of them when the step accumulates (`gradients_after`)."""
    return cost.grad_bytes if cost.grads_accumulate else cost.head_outside_grad_bytes


@dataclass(frozen=True)
class StepTerms:
    """The step-wide terms every element needs, computed once per cost (`step_terms`)."""

    base_bytes: int
    forward_grad_bytes: int
    gradients_after: tuple[int, ...]


def step_terms(cost: StepCost) -> StepTerms:
    return StepTerms(base_bytes(cost), forward_grad_bytes(cost), tuple(gradients_after(cost)))


def post_forward(cost: StepCost) -> int:
    """The peak after the last block during the forward (the head and the loss)."""
    return cost.post_saved_bytes if cost.post_forward_bytes is None else cost.post_forward_bytes


def end_need(cost: StepCost) -> int:
    """[constraint] The end of the forward and the head's backward, on top of what the
    blocks leave resident: the forward with last step's gradients still allocated (when they
    are), the head's backward with the gradients it makes (all of them when the step
    accumulates), both with the carried storages alive then."""
    head = max(post_forward(cost) + forward_grad_bytes(cost), cost.post_saved_bytes + head_grad_bytes(cost))
    return base_bytes(cost) + head + cost.carried_end_bytes


def end_relief(cost: StepCost, last_kept: bool) -> int:
    """[constraint] The head runs on the last block's output: already resident (not
    counted again in `end_need`) when that block is kept and saved it."""
    return cost.blocks[-1].output_saved_bytes if cost.n_blocks and last_kept else 0


def optimizer_need(cost: StepCost) -> int:
    """The optimizer step: parameters and state, all gradients, the optimizer's scratch (and the
    batch, which the training loop holds until the step ends)."""
    return cost.static_bytes + cost.batch_bytes + cost.grad_bytes + cost.optimizer_transient_bytes


# ----------------------------------------------------------------------------- elements (scalar form)


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

    [constraint] it leaves what it saved resident. Its forward also holds its output
    (less the part it saves) and its scratch, with last step's gradients allocated;
    its backward holds the gradient of its output and its scratch, with the
    gradients of later blocks. Both hold the carried storages alive then, its forward the
    part of its input no block saves; the gap after it runs on what it saved (less its
    output, which the gap's bytes hold).
    """
    blk = cost.blocks[p]
    base = terms.base_bytes + blk.saved_bytes
    fwd = base + terms.forward_grad_bytes + blk.output_bytes - blk.output_saved_bytes + blk.fwd_transient_bytes
    fwd = max(fwd + blk.input_unsaved_bytes + blk.carried_fwd_bytes, base + terms.forward_grad_bytes + gap_after(cost, p) - blk.output_saved_bytes)
    bwd = base + terms.gradients_after[p] + blk.output_bytes + blk.bwd_transient_bytes + blk.carried_bwd_bytes
    return Element(p, p, False, fwd, bwd, p, blk.saved_bytes)


def segment_elements(cost: StepCost, first: int, terms: StepTerms) -> Iterator[Element]:
    """The checkpointed segments [first, b] for b = first, first + 1, ... to the last
    block, each in O(1) from the one before (`terms` = `step_terms(cost)`).
    Chaining is not checked here: it decides which plans are valid, not their peak.

    [constraint] a segment leaves only its boundary (its first block's input) resident.
    Its forward saves nothing: block b holds its input and what it makes in flight
    (`ckpt_forward_bytes`), from the second block on beside the boundary. Its backward
    rebuilds the interior at once on top of the boundary (counted once when the first
    block saves its input); the last block's backward also sees the recompute's
    forward scratch, and block k < b runs its backward with blocks first..k rebuilt.
    Each block's forward and backward hold the carried storages alive then; the gap
    after block b runs on the boundary.
    """
    blocks = cost.blocks
    after = terms.gradients_after
    x = blocks[first].input_bytes
    fwd_base = terms.base_bytes + terms.forward_grad_bytes
    bwd_base = terms.base_bytes + x - blocks[first].input_saved_bytes
    fwd = rebuilt = scratch = 0
    inner, inner_at = None, first  # the largest backward of a block before b, and its block
    for b in range(first, len(blocks)):
        blk = blocks[b]
        fwd = max(fwd, fwd_base + (x if b > first else 0) + blk.input_bytes + ckpt_forward_bytes(blk) + blk.carried_fwd_bytes)
        rebuilt += blk.saved_bytes
        scratch = max(scratch, blk.fwd_transient_bytes)
        held = bwd_base + after[b] + rebuilt + blk.output_bytes + blk.carried_bwd_bytes
        last = held + max(blk.bwd_transient_bytes, scratch)
        out = max(fwd, fwd_base + x + gap_after(cost, b))
        if inner is None or last >= inner:
            yield Element(first, b, True, out, last, b, x)
        else:
            yield Element(first, b, True, out, inner, inner_at, x)
        if inner is None or held + blk.bwd_transient_bytes >= inner:
            inner, inner_at = held + blk.bwd_transient_bytes, b


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
    while i < n:
        if i in starts:
            el = next(e for e in segment_elements(cost, i, terms) if e.last == starts[i])
            if keeps.get(i):
                el = selective_element(el, kept_bytes(cost.blocks[i], keeps[i]))
            elif inner and direct_children(i, starts[i], inner):
                need, at = nested_backward(cost, i, starts[i], inner, terms, plain)
                el = el._replace(backward_bytes=terms.base_bytes + need, backward_block=at)
        else:
            el = kept_element(cost, i, terms)
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
    fwd, bwd, bwd_at = 0, base_bytes(cost), -1
    kept_last = False
    for el, shift in plan_elements(cost, segments, keeps, inner):
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


# ----------------------------------------------------------------------------- elements (numpy form)


@dataclass
class ElementArrays:
    """The element form as int64 columns over the blocks, for the exact chain planner.

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
    end_need: int
    opt_need: int
    saved: np.ndarray
    x: np.ndarray  # input_bytes
    xs: np.ndarray  # input_saved_bytes
    sh: np.ndarray  # shared_with_previous_bytes (n + 1, 0 at 0 and n)
    o: np.ndarray  # input_saved_by_previous_bytes (n + 1, 0 at 0, end relief at n)
    ft: np.ndarray  # fwd_transient_bytes
    bt: np.ndarray  # bwd_transient_bytes
    gap: np.ndarray  # the gap after each block (`gap_after`)
    cb: np.ndarray  # carried_bwd_bytes
    W: np.ndarray  # prefix sums of saved (n + 1)
    f: np.ndarray  # input + in-flight peak of a forward that saves nothing (a checkpointed block's), + carried
    v: np.ndarray  # G + W[b+1] + out + carried (G: gradients_after)
    inner: np.ndarray  # v + bt: backward of a non-last segment block, less the segment's base
    keep_need: np.ndarray


def element_arrays(cost: StepCost) -> ElementArrays:
    """The columns of `ElementArrays` for `cost` (the same terms as the scalar form)."""
    blocks = cost.blocks
    n = len(blocks)
    i64 = np.int64

    def col(name):
        return np.array([getattr(b, name) for b in blocks], dtype=i64) if n else np.zeros(0, dtype=i64)

    saved, x, xs, out, os_ = (col(k) for k in ("saved_bytes", "input_bytes", "input_saved_bytes", "output_bytes", "output_saved_bytes"))
    ft, bt, cf, cb, xu = (col(k) for k in ("fwd_transient_bytes", "bwd_transient_bytes", "carried_fwd_bytes", "carried_bwd_bytes", "input_unsaved_bytes"))
    gap = np.concatenate((col("gap_fwd_bytes")[1:], np.zeros(min(n, 1), dtype=i64)))
    G = np.array(gradients_after(cost), dtype=i64)
    sh = np.concatenate((col("shared_with_previous_bytes"), np.zeros(1, dtype=i64)))
    o = np.concatenate((col("input_saved_by_previous_bytes"), np.zeros(1, dtype=i64)))
    sh[0] = o[0] = 0  # nothing before block 0
    o[n] = end_relief(cost, True)
    W = np.zeros(n + 1, dtype=i64)
    np.cumsum(saved, out=W[1:])
    static, fwd_grads = base_bytes(cost), forward_grad_bytes(cost)
    v = G + W[1:] + out + cb
    return ElementArrays(
        n=n,
        static=static,
        fwd_grads=fwd_grads,
        least_bwd_grads=int(G.min()) if n else head_grad_bytes(cost),
        end_need=end_need(cost),
        opt_need=optimizer_need(cost),
        saved=saved,
        x=x,
        xs=xs,
        sh=sh,
        o=o,
        ft=ft,
        bt=bt,
        gap=gap,
        cb=cb,
        W=W,
        f=x + np.array([ckpt_forward_bytes(b) for b in blocks], dtype=i64).reshape(n) + cf,
        v=v,
        inner=v + bt,
        # [constraint] `kept_element`: forward, the gap after it or backward, on top of what it saved
        keep_need=static + saved + np.maximum(np.maximum(fwd_grads + out - os_ + ft + cf + xu, fwd_grads + gap - os_), G + out + bt + cb),
    )


def segment_need_rows(a: ElementArrays, p0: int, p1: int, width: int) -> np.ndarray:
    """need(p, p + t) of `segment_elements` for p in [p0, p1) (rows) and t < width
    (columns; where p + t is past the last block the values are meaningless)."""
    pad = np.zeros(width, dtype=np.int64)

    def win(arr):
        ext = np.concatenate((arr[p0 : min(p1 + width, a.n)], pad))
        return np.lib.stride_tricks.sliding_window_view(ext, width)[: p1 - p0]

    rows = slice(p0, p1)
    # [constraint] forward without saving: block b holds its input and what it makes in
    # flight (`f`), from b = p + 1 on top of the boundary x_p as well.
    fwd = win(a.f) + a.x[rows, None]
    fwd[:, 0] -= a.x[rows]
    np.maximum.accumulate(fwd, axis=1, out=fwd)
    np.maximum(fwd, win(a.gap) + a.x[rows, None], out=fwd)  # the gap after the segment, on its boundary
    fwd += a.static + a.fwd_grads
    # [constraint] backward: the interior is rebuilt at once on top of the boundary; the
    # last block's backward also sees the recompute's forward scratch; block k < b runs
    # its backward with blocks p..k still rebuilt.
    last = win(a.v) + np.maximum(win(a.bt), np.maximum.accumulate(win(a.ft), axis=1))
    if width > 1:
        inner = np.maximum.accumulate(win(a.inner), axis=1)
        np.maximum(last[:, 1:], inner[:, :-1], out=last[:, 1:])
    last += (a.static + a.x[rows] - a.xs[rows] - a.W[rows])[:, None]
    return np.maximum(fwd, last, out=fwd)


def single_segment_parts(a: ElementArrays) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward bytes of every one-block segment [p, p] (`segment_elements`),
    apart: a selective block adds its kept bytes to the forward only (`selective_element`)."""
    fwd = a.static + a.fwd_grads + np.maximum(a.f, a.x + a.gap)
    bwd = a.static + a.x - a.xs + a.v - a.W[:-1] + np.maximum(a.bt, a.ft)
    return fwd, bwd
