"""Plain data describing what a training step costs, block by block.

`BlockCost` is one block of the chain at one batch size; `StepCost` is the whole
step (blocks plus what lives outside them: embedding, head, loss, parameters,
gradients and optimizer state). The profiler produces these, the memory model and
the planners consume them. No torch, no Lightning: numbers only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lightning_ckpt.costs.machine_rates import MachineRates


@dataclass(frozen=True)
class OpCost:
    """One op call inside a block's forward, for op-level (selective) plans.

    op: the aten overload, as ``str(func)`` (e.g. ``"aten.mm.default"``).
    call_index: how many calls of the same `op` came before this one in the block's
        forward (0 for the first). `op` and `call_index` together name the call the same
        way torch's selective checkpoint contexts count it inside a checkpointed block.
    keep_bytes: bytes held from the forward to the block's backward when this call's
        outputs are kept instead of recomputed (unique output storages; for a random op,
        the copy that keeps its draws: one byte per element of a bernoulli mask, else its
        outputs' bytes, `op_profile.kept_draw_bytes`).
    saved: autograd saves one of its output storages for backward.
    keepable: keeping it is possible: its outputs are new storages (not views of or
        writes into its inputs), or it is a random op whose draws can be replayed.
    in_tail: it runs after the block's last saved tensor, so torch's early stop never
        recomputes it when the block ends its region.
    flops, mem_bytes, rng_bytes: its forward work, split as in `BlockCost` (FLOPs,
        bytes written by ops without FLOPs, bytes written by random ops).
    """

    op: str
    call_index: int
    keep_bytes: int
    saved: bool
    keepable: bool
    in_tail: bool = False
    flops: int = 0
    mem_bytes: int = 0
    rng_bytes: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return (self.op, self.call_index)


# measured differences of two times: a negative one is information (keeping lost time), not an error
_SIGNED = ("keep_saved_ms", "keep_draws_saved_ms")


@dataclass(frozen=True)
class BlockCost:
    """One block of the chain at one batch size.

    saved_bytes: unique storages the block's ops save for backward (parameters
        excluded), including its input when an op saves it.
    input_bytes: the block's input (the boundary kept when a segment starts here).
    input_saved_bytes: the part of `input_bytes` that is also in `saved_bytes`
        (the block's own ops save their input, e.g. a pre-norm LayerNorm).
    shared_with_previous_bytes: storages this block's ops save that the previous
        block's ops saved first (typically the previous block's output, kept by a
        final ReLU there and by the first conv here). A storage counts once, with
        the first block that saves it, so these are not in `saved_bytes`; they are
        resident on this block's account only when this block is kept and the
        previous one is checkpointed.
    input_saved_by_previous_bytes: the block's input storage when the previous
        block's ops saved it; a segment starting here then finds its boundary
        already resident if the previous block is kept.
    input_unsaved_bytes: the part of `input_bytes` that neither this block nor the previous one
        saves: only the caller holds it, for as long as the block runs, so a kept block's forward
        holds it too (a checkpointed one holds its whole input anyway).
    output_bytes: the block's output; in backward the gradient of it is this large.
    output_saved_bytes: the part of `output_bytes` that is also in `saved_bytes`
        (the block's last op saves its result, e.g. a ReLU); not counted twice.
    fwd_transient_bytes: peak extra bytes live during the block's forward beyond
        what it saves and returns (scratch space).
    stop_output_bytes: the part of `output_bytes` not in `saved_bytes` that exists when the
        block's last saved tensor is saved: the op that saves last made it first (LayerNorm
        saves its mean and rstd after making its output), so a recompute that stops there
        (torch's early stop) holds it too. 0 when the output is made after that.
    ckpt_fwd_peak_bytes: peak bytes above what was live at the block's entry during
        a forward that saves nothing (as inside a checkpointed segment): intermediates
        live only until the next op consumes them, plus the output. None when not
        measured; the model then uses `saved + output + scratch - input saved`.
    bwd_transient_bytes: peak extra bytes during the block's backward beyond what
        was live when it started (gradient scratch, its parameter gradients), with every
        `.grad` unset as profiled: each parameter gradient it makes stays from then on.
    kept_grads_bwd_transient_bytes: the same peak when the parameters' gradients exist already
        (gradient accumulation, a loop that zeroes them with `set_to_none=False`): autograd adds each
        new gradient into its `.grad` in place and frees it, so only the gradients made and not yet
        added count (`backward_phase_peaks`). None when not measured: `bwd_transient_bytes`, which is
        never less, stands in for it.
    bwd_phase_bytes: the block's backward cut at every birth and every write of a parameter
        gradient, as measured in one probe: per stretch (the peak of all but those gradients above
        the backward's start, which may be negative; the gradients made so far in the backward; the
        gradients made and not yet written into `.grad`, less those made earlier and written here).
        The first part grows with the batch, the others do not, so each stretch is a line of its own
        (`linear_fit`): which stretch peaks moves as the batch grows. Empty in a fitted cost.
    grad_bytes: bytes of the gradients of the block's trainable parameters.
    fwd_flops: forward FLOPs (what one recompute costs).
    tail_flops: FLOPs of the ops after the block's last saved tensor. When the block
        ends a segment, torch's early stop skips them in the recompute.
    fwd_mem_bytes: bytes written in the forward by ops that count 0 FLOPs (layer norm,
        softmax, GELU, adds, ...; `op_bytes.written_bytes` defines them), random-number
        ops excepted. Not memory held: work, like `fwd_flops`.
    tail_mem_bytes: the part of `fwd_mem_bytes` after the last saved tensor.
    fwd_rng_bytes: bytes written by random-number ops (dropout's `bernoulli_`).
    tail_rng_bytes: the part of `fwd_rng_bytes` after the last saved tensor.
    fwd_comm_bytes: bytes the forward moves through functional collectives (tensor parallelism's
        all-reduce after a row-wise layer, sequence parallelism's all-gather and reduce-scatter), as
        all-gather outputs that move as much per rank (`profiling.work.tp_work`): a recompute runs them
        again, at the measured all-gather rate (`MachineRates.gather_byte_per_s`). Work, not memory.
    tail_comm_bytes: the part of `fwd_comm_bytes` after the last saved tensor.
    fwd_ms: measured forward wall time, milliseconds.
    chains_from_previous: the block's first input is the previous block's output, or an alias of
        it (`chaining.receives_output`); needed to run several blocks in one checkpointed segment.
    gather_bytes: parameter bytes the block's recompute all-gathers beyond a step without
        checkpointing (ZeRO-3 fetches its partitioned parameters again; `profiling.work.gather`).
        The same at every batch size; 0 when the block is not sharded.
    ops: the block's op calls in forward order (`OpCost`); empty when not profiled per op.
    keep_saved_ms: measured time one forward + backward of the block, checkpointed alone, saves
        when it keeps every call an op-level option may keep (`op_options.option_items`) instead
        of none; negative when keeping cost more than it saved. None when not measured
        (`lightning_ckpt.apply.keep_calibration`).
    keep_draws_saved_ms: the same when it keeps only its random calls; None when not measured
        or when it has none to keep.
    carried_fwd_bytes: storages that outlive their neighbour edge (`profiling.memory.lifetimes`: a U-Net
        skip, the encoder output every decoder block reads, what modules outside the chain save, a
        block's output kept for a later module) alive while this block runs forward. Such a storage
        is in no other field of any block: its bytes are counted here and in `carried_bwd_bytes`
        for every phase of its measured life, whatever the plan.
    carried_bwd_bytes: the same while this block's backward runs (with that of the modules outside
        the chain just before it), plus the gradients of carried storages that later modules' backward
        made and this block's has not consumed yet.
    gap_fwd_bytes: the forward of the modules outside the chain that run after the previous block
        and before this one (the gap): their peak above the bytes resident before the previous
        block, the previous block's output and the carried bytes included; 0 when the gap runs no
        op. A block after a gap that runs ops does not chain from the previous block.
    gap_grad_bytes: gradients of trainable parameters outside the blocks (part of
        `StepCost.outside_grad_bytes`) whose last use in the forward is in the gap before this
        block or in this block (block 0: anywhere before it): the backward makes them after this
        block's, so no earlier backward holds them. Batch-independent, like `grad_bytes`.
    unreplayable: Python state the block's forward writes that a recompute cannot replay (an
        attribute that decides a branch, a list it appends to, draws of `random` or NumPy), one
        reason per write ("blocks.1.calls: 0 -> 1"). Planning keeps such a block (never in a
        segment) unless the user allows it (`allow_python_state`).
    written_state_bytes: module state the block's forward writes (buffers and tensor attributes
        written in place, resized or rebound: BatchNorm statistics, spectral norm's vectors, QAT
        observers), as large as after the forward. A checkpointed block's copy of it lives from
        its forward to its recompute (`apply.state_guard`). Batch-independent, like `grad_bytes`.
    """

    name: str
    saved_bytes: int
    input_bytes: int
    input_saved_bytes: int = 0
    shared_with_previous_bytes: int = 0
    input_saved_by_previous_bytes: int = 0
    output_bytes: int = 0
    output_saved_bytes: int = 0
    fwd_transient_bytes: int = 0
    stop_output_bytes: int = 0
    ckpt_fwd_peak_bytes: int | None = None
    bwd_transient_bytes: int = 0
    grad_bytes: int = 0
    fwd_flops: int = 0
    tail_flops: int = 0
    fwd_mem_bytes: int = 0
    tail_mem_bytes: int = 0
    fwd_rng_bytes: int = 0
    tail_rng_bytes: int = 0
    fwd_comm_bytes: int = 0
    tail_comm_bytes: int = 0
    fwd_ms: float = 0.0
    chains_from_previous: bool = True
    gather_bytes: int = 0
    ops: tuple[OpCost, ...] = ()
    keep_saved_ms: float | None = None
    keep_draws_saved_ms: float | None = None
    carried_fwd_bytes: int = 0
    carried_bwd_bytes: int = 0
    gap_fwd_bytes: int = 0
    input_unsaved_bytes: int = 0
    gap_grad_bytes: int = 0
    unreplayable: tuple[str, ...] = ()
    written_state_bytes: int = 0
    kept_grads_bwd_transient_bytes: int | None = None
    bwd_phase_bytes: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.unreplayable, tuple):  # a list once it went through JSON
            object.__setattr__(self, "unreplayable", tuple(self.unreplayable))
        if not isinstance(self.bwd_phase_bytes, tuple) or any(not isinstance(p, tuple) for p in self.bwd_phase_bytes):
            object.__setattr__(self, "bwd_phase_bytes", tuple(tuple(int(v) for v in p) for p in self.bwd_phase_bytes))
        for name in _NONNEGATIVE:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(
                    f"BlockCost {self.name!r}: {name}={value} is negative; costs are sizes and times, "
                    "so they must be >= 0. Check the profile that produced it."
                )
        kept = self.kept_grads_bwd_transient_bytes
        if kept is not None and kept > self.bwd_transient_bytes:
            raise ValueError(
                f"BlockCost {self.name!r}: kept_grads_bwd_transient_bytes={kept} exceeds bwd_transient_bytes="
                f"{self.bwd_transient_bytes}; a backward into existing gradients frees each new one once it is "
                "added, so it never holds more than one whose gradients stay. Check the profile that produced it."
            )
        if self.input_saved_bytes > self.input_bytes:
            raise ValueError(
                f"BlockCost {self.name!r}: input_saved_bytes={self.input_saved_bytes} exceeds "
                f"input_bytes={self.input_bytes}; a block cannot save more of its input than it receives."
            )
        if self.input_unsaved_bytes > self.input_bytes:
            raise ValueError(
                f"BlockCost {self.name!r}: input_unsaved_bytes={self.input_unsaved_bytes} exceeds "
                f"input_bytes={self.input_bytes}; the unsaved part of the input cannot be larger than the input."
            )
        if self.output_saved_bytes > self.output_bytes:
            raise ValueError(
                f"BlockCost {self.name!r}: output_saved_bytes={self.output_saved_bytes} exceeds "
                f"output_bytes={self.output_bytes}; a block cannot save more of its output than it returns."
            )
        if self.input_saved_by_previous_bytes > self.input_bytes:
            raise ValueError(
                f"BlockCost {self.name!r}: input_saved_by_previous_bytes={self.input_saved_by_previous_bytes} "
                f"exceeds input_bytes={self.input_bytes}; the previous block cannot have saved more of this "
                "block's input than there is."
            )


# the sizes and times a BlockCost checks for >= 0, in field order (the first negative one is named)
_NONNEGATIVE = tuple(
    f.name for f in dataclasses.fields(BlockCost)
    if f.name not in (*_SIGNED, "bwd_phase_bytes") and f.name.endswith(("_bytes", "_flops", "_ms"))
)


def backward_phase_peaks(phases) -> tuple[int, int]:
    """(`bwd_transient_bytes`, `kept_grads_bwd_transient_bytes`) of a block from its `bwd_phase_bytes`:
    the largest stretch with the gradients made so far (with `.grad` unset they stay), and with only
    those in flight (with gradients kept, autograd adds each new one in place and frees it). Each at
    least 0: the backward's start is a stretch's too."""
    unset = max((rest + made for rest, made, _ in phases), default=0)
    kept = max((rest + flight for rest, _, flight in phases), default=0)
    unset, kept = max(0, int(round(unset))), max(0, int(round(kept)))
    return unset, min(kept, unset)


@dataclass(frozen=True)
class StepCost:
    """The whole training step at one batch size.

    static_bytes: parameters, buffers and optimizer state, resident all step.
    outside_grad_bytes: gradients of trainable parameters outside the blocks; the head's
        backward makes them, but for those `BlockCost.gap_grad_bytes` says come later.
    pre_saved_bytes: activations saved before the first block (embedding, ...).
    batch_bytes: the batch itself (inputs and targets on the device): alive all step,
        and not counted in any block's saved or boundary bytes.
    post_saved_bytes: activations saved after the last block (pooling, head, loss),
        plus the transient peak there, up to the first block gradient (so it
        includes the head's backward and the gradient of the last block's output).
    post_forward_bytes: the same peak, but over the forward only (the head and the
        loss); None when not measured, then `post_saved_bytes` stands in for it.
    grads_live_in_forward: parameter gradients of the previous step are still
        allocated during the forward (Lightning zeroes them after the forward; a plain loop
        that frees them before it, with `zero_grad()` at the end of a step, does not).
    grads_accumulate: the step is a micro-batch that accumulates into gradients earlier
        micro-batches made (Lightning's `accumulate_grad_batches` > 1, or any loop that calls
        backward several times per optimizer step, or keeps its gradients zeroed in place with
        `zero_grad(set_to_none=False)`): every parameter gradient is allocated throughout its
        forward and its backward, not only those of blocks whose backward is done. A new
        gradient autograd adds in place into an existing one is scratch of the backward that
        makes it, alive until it is added: each block's `kept_grads_bwd_transient_bytes`.
    optimizer_transient_bytes: scratch space of the optimizer step.
    grads_on_device: False when the strategy moves each parameter gradient off the device as the
        backward makes it (ZeRO-Offload, FSDP2's CPU offloading; the buckets it passes through are
        static memory): the gradients of finished blocks, of the last step and of earlier
        micro-batches are then not on the device. A block's own gradients, made in its backward,
        stay in its `bwd_transient_bytes`.
    carried_end_bytes: carried storages (`BlockCost.carried_fwd_bytes`) alive when the last block's
        forward ends: the head, the loss and the head's backward run on top of them.
    meta: what explains the numbers: `step_fwd_flops`, and `rates` (a
        `MachineRates.to_dict()`) when the profile measured them.
    """

    blocks: tuple[BlockCost, ...]
    batch_size: int
    static_bytes: int = 0
    outside_grad_bytes: int = 0
    pre_saved_bytes: int = 0
    batch_bytes: int = 0
    post_saved_bytes: int = 0
    post_forward_bytes: int | None = None
    grads_live_in_forward: bool = True
    grads_accumulate: bool = False
    optimizer_transient_bytes: int = 0
    carried_end_bytes: int = 0
    grads_on_device: bool = True
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        late = sum(b.gap_grad_bytes for b in self.blocks)
        if late > self.outside_grad_bytes:
            raise ValueError(
                f"StepCost: the blocks' gap_grad_bytes sum to {late}, more than outside_grad_bytes="
                f"{self.outside_grad_bytes}; they are the part of the gradients outside the blocks that the "
                "backward makes late, so they cannot exceed them. Check the profile that produced it."
            )

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def head_outside_grad_bytes(self) -> int:
        """The gradients outside the blocks that the head's backward makes (last used after the chain)."""
        return self.outside_grad_bytes - sum(b.gap_grad_bytes for b in self.blocks)

    @property
    def rates(self) -> MachineRates | None:
        """The machine rates measured with the profile, or None."""
        data = self.meta.get("rates")
        return None if data is None else _rates_of(data)

    @property
    def grad_bytes(self) -> int:
        return self.outside_grad_bytes + sum(b.grad_bytes for b in self.blocks)

    @property
    def device_grad_bytes(self) -> int:
        """The parameter gradients when all exist on the device: `grad_bytes`, or 0 when they leave it."""
        return self.grad_bytes if self.grads_on_device else 0

    def to_dict(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "static_bytes": self.static_bytes,
            "outside_grad_bytes": self.outside_grad_bytes,
            "pre_saved_bytes": self.pre_saved_bytes,
            "batch_bytes": self.batch_bytes,
            "post_saved_bytes": self.post_saved_bytes,
            "post_forward_bytes": self.post_forward_bytes,
            "grads_live_in_forward": self.grads_live_in_forward,
            "grads_accumulate": self.grads_accumulate,
            "optimizer_transient_bytes": self.optimizer_transient_bytes,
            "carried_end_bytes": self.carried_end_bytes,
            "grads_on_device": self.grads_on_device,
            "blocks": [dataclasses.asdict(b) for b in self.blocks],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "StepCost":
        data = dict(data)
        blocks = tuple(
            BlockCost(**{**b, "ops": tuple(OpCost(**o) for o in b.get("ops", ()))}) for b in data.pop("blocks")
        )
        return cls(blocks=blocks, **data)


# id -> (the dict, its items, its rates): every cost of a profile shares the profile's dict of rates (`Profile.at`
# and the fits pass it on), so each planner call that reads `StepCost.rates` finds it here instead of checking
# the rates again; the dict is held so that its id names it, and its items tell a dict changed since
_RATES_MADE: dict[int, tuple[dict, tuple, MachineRates]] = {}
_RATES_KEPT = 64


def _rates_of(data: dict) -> MachineRates:
    """`MachineRates.from_dict(data)`, made once per dict of rates."""
    items = tuple(data.items())
    made = _RATES_MADE.get(id(data))
    if made is not None and made[0] is data and made[1] == items:
        return made[2]
    rates = MachineRates.from_dict(data)
    if len(_RATES_MADE) >= _RATES_KEPT:
        _RATES_MADE.clear()
    _RATES_MADE[id(data)] = (data, items, rates)
    return rates
