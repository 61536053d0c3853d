"""Per-rank static memory of DeepSpeed ZeRO stages 0-3 with an Adam-style optimizer.

Plain arithmetic over parameter sizes: for a ZeRO stage, world size and Lightning
precision, the bytes one rank holds for parameters, gradients, fp32 master weights
and AdamW's two moments, plus DeepSpeed's gradient buckets and (stage 3) gathered
parameters. Each rule names the DeepSpeed structure it stands for; what is held
between steps matches DeepSpeed 0.19's tensors byte for byte (`tests/test_zero_memory.py`).
No Lightning or DeepSpeed imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_ckpt.profiling.static_memory import StaticMemory

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
STAGES = (0, 1, 2, 3)

# Bytes of one element of the parameters as DeepSpeed stores them: Lightning's
# `bf16-mixed` makes DeepSpeed cast the whole model to bf16, exactly as `bf16-true`.
PARAM_ELEMENT_BYTES = {"32-true": 4, "bf16-mixed": 2, "bf16-true": 2}
FP32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32, one element per master weight
STEP_COUNTER_BYTES = 4  # torch's Adam keeps `step` as a float32 scalar tensor per parameter tensor


@dataclass(frozen=True)
class ZeroMemory:
    """What one rank holds under ZeRO, by kind (bytes).

    param_bytes: the module's parameters as stored on this rank: whole (stages 0-2),
        or this rank's partition of each plus whole copies of persistent ones (stage 3).
    grad_bytes: gradient storage kept across steps (stage 3's partition buffer).
    master_bytes: fp32 master weights kept by the optimizer wrapper (whole at stage 0
        with bf16, this rank's partition at stages 1-3, none at stage 0 in fp32).
    optimizer_state_bytes: AdamW's two moments and step counters.
    bucket_bytes: DeepSpeed's contiguous gradient buckets; kept across steps at stage 3,
        allocated for each backward at stages 1-2 (`bucket_persistent` says which; the
        stage 1-2 size is read from DeepSpeed's source, not measured).
    step_transient_bytes: scratch of one optimizer step (fp32 gradient partition and
        the update's temporaries): an estimate, not measured.
    gather_bytes: stage 3: parameters gathered whole for the forward and backward. With a
        complete trace DeepSpeed prefetches and keeps gathered every parameter it will reuse
        within ``stage3_max_reuse_distance`` elements (default 1e9), capped by
        ``stage3_max_live_parameters`` (default 1e9): for models below that, about all of
        them, from the forward into the backward. Not held between steps.
    buffer_bytes: the module's buffers (never partitioned).
    """

    stage: int
    world_size: int
    precision: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    bucket_bytes: int
    bucket_persistent: bool
    step_transient_bytes: int
    gather_bytes: int = 0
    buffer_bytes: int = 0

    @property
    def held_bytes(self) -> int:
        """Bytes held between steps: what DeepSpeed keeps allocated after `step()`."""
        return (
            self.param_bytes
            + self.buffer_bytes
            + self.grad_bytes
            + self.master_bytes
            + self.optimizer_state_bytes
            + (self.bucket_bytes if self.bucket_persistent else 0)
        )

    def to_static_memory(self) -> StaticMemory:
        """As the planner's `StaticMemory`. Everything held between steps is resident; the
        per-backward buckets of stages 1-2 and stage 3's gathered parameters are counted as
        resident too (the memory model has no forward/backward-only term, so this is
        conservative by at most their size during the optimizer step)."""
        optimizer = self.master_bytes + self.optimizer_state_bytes + self.grad_bytes + self.bucket_bytes
        return StaticMemory(
            param_bytes=self.param_bytes + self.gather_bytes,
            buffer_bytes=self.buffer_bytes,
            grad_bytes=self.grad_bytes,
            optimizer_state_bytes=optimizer,
            optimizer_transient_bytes=self.step_transient_bytes,
        )


def _partition(numel: int, world_size: int) -> int:
    """Elements of one rank's share of `numel` (DeepSpeed pads to equal shares)."""
    return -(-numel // world_size)


def zero_memory(
    params: Iterable[tuple[int, bool]],
    stage: int,
    world_size: int,
    precision: str,
    persistence_threshold: int = 100_000,
    reduce_bucket_size: int = 500_000_000,
    contiguous_gradients: bool = True,
    overlap_comm: bool = False,
    max_live_parameters: int = 1_000_000_000,
    buffer_bytes: int = 0,
) -> ZeroMemory:
    """Per-rank bytes for parameters given as `(elements, trainable)` pairs.

    `persistence_threshold` is ZeRO-3's ``stage3_param_persistence_threshold`` (parameters
    with at most that many elements stay whole on every rank); the bucket arguments are
    DeepSpeed's ``reduce_bucket_size``, ``contiguous_gradients`` and ``overlap_comm``;
    `max_live_parameters` is ``stage3_max_live_parameters``.
    Gradients are accumulated in the parameters' dtype (DeepSpeed's default when the
    config sets no ``data_types.grad_accum_dtype``).
    """
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use one of {STAGES}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer (the number of data-parallel ranks).")
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not modelled; the ZeRO memory model knows {', '.join(PRECISIONS)}."
        )
    sizes: Sequence[tuple[int, bool]] = [(int(n), bool(t)) for n, t in params]
    if any(n < 0 for n, _ in sizes):
        raise ValueError("parameter sizes must be non-negative numbers of elements.")
    w = PARAM_ELEMENT_BYTES[precision]
    n_all = sum(n for n, _ in sizes)
    trainable = [n for n, t in sizes if t]
    n_train = sum(trainable)
    bf16 = precision != "32-true"

    if stage == 0:
        # No partitioning. fp32: torch's AdamW steps the module's own parameters. bf16:
        # DeepSpeed's unfused fp16/bf16 wrapper keeps an fp32 master copy of each one.
        master = FP32 * n_train if bf16 else 0
        moments = ADAM_MOMENTS * FP32 * n_train + STEP_COUNTER_BYTES * len(trainable)
        return ZeroMemory(
            stage, world_size, precision,
            param_bytes=w * n_all,
            grad_bytes=0,  # freed by the engine after each step
            master_bytes=master,
            optimizer_state_bytes=moments,
            bucket_bytes=0,
            bucket_persistent=False,
            step_transient_bytes=FP32 * n_train + 2 * FP32 * max(trainable, default=0),
            buffer_bytes=buffer_bytes,
        )

    if stage in (1, 2):
        # Whole parameters in one flat buffer per group; the optimizer owns this rank's
        # fp32 partition of the flat trainable parameters (a copy even in fp32) and the
        # moments of that partition. Gradient partitions exist only from the end of the
        # backward to the end of the step.
        part = _partition(n_train, world_size)
        # Each backward allocates one contiguous bucket of `reduce_bucket_size` elements in
        # the gradients' dtype, two when communication overlaps the backward.
        buckets = (2 if overlap_comm else 1) * reduce_bucket_size * w if contiguous_gradients and trainable else 0
        return ZeroMemory(
            stage, world_size, precision,
            param_bytes=w * n_all,
            grad_bytes=0,
            master_bytes=FP32 * part,
            optimizer_state_bytes=ADAM_MOMENTS * FP32 * part + STEP_COUNTER_BYTES,
            bucket_bytes=buckets,
            bucket_persistent=False,
            step_transient_bytes=FP32 * part + 2 * FP32 * part,
            buffer_bytes=buffer_bytes,
        )

    # Stage 3: every parameter is split into equal per-rank partitions (trainable or not);
    # parameters up to `persistence_threshold` elements also stay whole on every rank.
    # Gradients are reduced into a flat partition buffer kept across steps, and each
    # gradient dtype has one contiguous bucket of `reduce_bucket_size` elements.
    parts = sum(_partition(n, world_size) for n, _ in sizes)
    persistent = sum(n for n, _ in sizes if n <= persistence_threshold)
    train_part = sum(_partition(n, world_size) for n in trainable)
    gathered = min(n_all - persistent, max_live_parameters)
    return ZeroMemory(
        stage, world_size, precision,
        param_bytes=w * (parts + persistent),
        grad_bytes=w * train_part,
        master_bytes=FP32 * train_part,
        optimizer_state_bytes=ADAM_MOMENTS * FP32 * train_part + STEP_COUNTER_BYTES,
        bucket_bytes=reduce_bucket_size * w if contiguous_gradients and trainable else 0,
        bucket_persistent=True,
        step_transient_bytes=2 * FP32 * train_part,
        gather_bytes=w * gathered,
        buffer_bytes=buffer_bytes,
    )


def zero_static_memory(params: Iterable[tuple[int, bool]], **kwargs) -> StaticMemory:
    """`zero_memory(...)` as the planner's `StaticMemory`."""
    return zero_memory(params, **kwargs).to_static_memory()
