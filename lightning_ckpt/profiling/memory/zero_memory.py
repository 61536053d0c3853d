"""Per-rank static memory of DeepSpeed ZeRO stages 0-3 with an Adam-style optimizer, offloading included.

Plain arithmetic over parameter sizes: for a ZeRO stage, world size and Lightning
precision, the bytes one rank holds for parameters, gradients, fp32 master weights
and AdamW's two moments, plus DeepSpeed's gradient buckets and (stage 3) gathered
parameters; under ZeRO-Offload (`ZeroOffload`), which of them stay on the device and which
live in host memory or on NVMe. Each rule names the DeepSpeed structure it stands for; what is
held between steps matches DeepSpeed 0.19's tensors byte for byte (`tests/test_zero_memory.py`).
No Lightning or DeepSpeed imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_ckpt.profiling.memory.static_memory import StaticMemory

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# Bytes of one element of the parameters as DeepSpeed stores them: Lightning's
# `bf16-mixed` makes DeepSpeed cast the whole model to bf16, exactly as `bf16-true`.
PARAM_ELEMENT_BYTES = {"32-true": 4, "bf16-mixed": 2, "bf16-true": 2}
FP32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32, one element per master weight
STEP_COUNTER_BYTES = 4  # torch's Adam keeps `step` as a float32 scalar tensor per parameter tensor


@dataclass(frozen=True)
class ZeroOffload:
    """ZeRO-Offload as configured: DeepSpeed's ``offload_optimizer`` and ``offload_param`` sections.

    optimizer_device: ``offload_optimizer.device``: "none", "cpu" or "nvme". Stages 1-2 keep the
        optimizer in host memory for either ("nvme" swapping exists at stage 3 only).
    param_device: ``offload_param.device`` (stage 3 only): where the parameter partitions live.
    optimizer_buffer_count: ``offload_optimizer.buffer_count``: NVMe swap buffers in host memory.
    param_buffer_count, param_buffer_elements: ``offload_param.buffer_count`` and ``buffer_size``.
    param_max_in_cpu_elements: ``offload_param.max_in_cpu``: partitions kept in host memory under NVMe.
    sub_group_elements: ``sub_group_size``: stage 3 steps the optimizer one sub-group of this many
        partition elements at a time (NVMe swap buffers hold the largest).
    """

    optimizer_device: str = "none"
    param_device: str = "none"
    optimizer_buffer_count: int = 4
    param_buffer_count: int = 5
    param_buffer_elements: int = 100_000_000
    param_max_in_cpu_elements: int = 1_000_000_000
    sub_group_elements: int = 1_000_000_000_000

    def __post_init__(self) -> None:
        for name in ("optimizer_device", "param_device"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise ValueError(
                    f"ZeroOffload {name}={getattr(self, name)!r} is not a DeepSpeed offload device; use one of "
                    f"{', '.join(OFFLOAD_DEVICES)}."
                )

    @property
    def optimizer(self) -> bool:
        return self.optimizer_device != "none"

    @property
    def params(self) -> bool:
        return self.param_device != "none"


NO_OFFLOAD = ZeroOffload()


@dataclass(frozen=True)
class ZeroMemory:
    """What one rank holds under ZeRO, by kind (bytes). Every field without `host_` or `nvme_`
    in its name is device memory.

    param_bytes: the module's parameters as stored on the device: whole (stages 0-2), or this
        rank's partition of each plus whole copies of persistent ones (stage 3; the copies only
        under ``offload_param``).
    grad_bytes: gradient storage kept across steps on the device (stage 3's partition buffer).
    master_bytes: fp32 master weights kept by the optimizer wrapper on the device (whole at stage
        0 with bf16, this rank's partition at stages 1-3, none at stage 0 in fp32 or offloaded).
    optimizer_state_bytes: AdamW's two moments and step counters on the device.
    bucket_bytes: DeepSpeed's contiguous gradient buckets; kept across steps at stage 3,
        allocated for each backward at stages 1-2 (`bucket_persistent` says which; the
        stage 1-2 size is read from DeepSpeed's source, not measured).
    step_transient_bytes: device scratch of one optimizer step (fp32 gradient partition and the
        update's temporaries; offloaded: one gradient's fp32 copy on its way to the host): an estimate.
    gather_bytes: stage 3: parameters gathered whole at once for the forward and backward. With a
        complete trace DeepSpeed prefetches and keeps gathered every parameter it will reuse
        within ``stage3_max_reuse_distance`` elements (default 1e9), capped by
        ``stage3_max_live_parameters`` (default 1e9): for models below that, about all of
        them, from the forward into the backward. Not held between steps. 0 on one rank when the
        partitions are on the device (the gathered parameter is its partition).
    buffer_bytes: the module's buffers (never partitioned).
    offload_buffer_bytes: device buffers DeepSpeed keeps for the copies to and from the host
        (stages 1-2: ``temp_grad_buffer_for_gpu_offload``, as large as the largest parameter).
    grads_on_device: False when each gradient leaves the device through the buckets as the
        backward makes it (offloaded optimizer at stages 2-3, or stage 1 with ``overlap_comm``):
        the parameter gradients do not build up on the device.
    host_master_bytes, host_grad_bytes, host_optimizer_state_bytes: the fp32 master partition, its
        fp32 gradient partition and the moments, in host memory under ``offload_optimizer``.
    host_param_bytes: stage 3 ``offload_param``: the parameter partitions in host memory.
    host_buffer_bytes: host buffers of the copies: the low-precision copy of the master partition
        and a one-parameter gradient buffer (stages 1-2), the low-precision gradient partition
        (stage 3), gradients accumulated over micro-batches, NVMe swap buffers.
    nvme_bytes: what is swapped out to NVMe (``device: nvme`` at stage 3).
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
    offload_buffer_bytes: int = 0
    grads_on_device: bool = True
    host_master_bytes: int = 0
    host_grad_bytes: int = 0
    host_optimizer_state_bytes: int = 0
    host_param_bytes: int = 0
    host_buffer_bytes: int = 0
    nvme_bytes: int = 0

    @property
    def host_parts(self) -> tuple[tuple[str, int], ...]:
        """(what, bytes) of every non-empty part held in host memory."""
        parts = (
            ("fp32 master weights", self.host_master_bytes), ("fp32 gradients", self.host_grad_bytes),
            ("optimizer state", self.host_optimizer_state_bytes), ("parameter partitions", self.host_param_bytes),
            ("copy buffers", self.host_buffer_bytes),
        )
        return tuple((what, n) for what, n in parts if n)

    @property
    def host_bytes(self) -> int:
        """Bytes this rank keeps in host memory (offloaded state and DeepSpeed's host buffers)."""
        return sum(n for _, n in self.host_parts)

    @property
    def device_held_bytes(self) -> int:
        """Device bytes held between steps: what DeepSpeed keeps allocated on the device after `step()`."""
        return (
            self.param_bytes
            + self.buffer_bytes
            + self.grad_bytes
            + self.master_bytes
            + self.optimizer_state_bytes
            + self.offload_buffer_bytes
            + (self.bucket_bytes if self.bucket_persistent else 0)
        )

    @property
    def held_bytes(self) -> int:
        """Bytes held between steps, on the device and in host memory (on a CPU-only machine both are
        the process's memory: what DeepSpeed keeps allocated after `step()`)."""
        return self.device_held_bytes + self.host_bytes

    def to_static_memory(self) -> StaticMemory:
        """As the planner's `StaticMemory`: what stays on the device, and what lives in host memory
        and on NVMe beside it. Everything held on the device between steps is resident; the
        per-backward buckets of stages 1-2 and stage 3's gathered parameters are counted as
        resident too (the memory model has no forward/backward-only term, so this is
        conservative by at most their size during the optimizer step)."""
        return StaticMemory(
            param_bytes=self.param_bytes + self.gather_bytes,
            buffer_bytes=self.buffer_bytes,
            grad_bytes=self.grad_bytes,
            optimizer_state_bytes=self.master_bytes + self.optimizer_state_bytes + self.grad_bytes,
            optimizer_transient_bytes=self.step_transient_bytes,
            comm_buffer_bytes=self.bucket_bytes + self.offload_buffer_bytes,
            grads_on_device=self.grads_on_device,
            host_parts=self.host_parts,
            nvme_bytes=self.nvme_bytes,
        )


def _partition(numel: int, world_size: int) -> int:
    """Elements of one rank's share of `numel` (DeepSpeed pads to equal shares)."""
    return -(-numel // world_size)


def _largest_sub_group(partitions: Sequence[int], sub_group_elements: int) -> int:
    """Elements of stage 3's largest optimizer sub-group: partitions in order, a group closed once it
    holds at least `sub_group_elements` (`DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups`)."""
    largest = current = 0
    for n in partitions:
        current += n
        if current >= sub_group_elements:
            largest, current = max(largest, current), 0
    return max(largest, current)


def _gathered(
    non_persistent: int, max_live_parameters: int, largest_module_elements: int | None,
    prefetch_bucket_size: int, max_reuse_distance: int,
) -> int:
    """Stage 3: elements gathered whole at once. DeepSpeed fetches a module's own parameters before it
    runs; with a complete trace it also prefetches up to ``stage3_prefetch_bucket_size`` elements
    (within ``stage3_max_live_parameters``) and does not release a parameter used again within
    ``stage3_max_reuse_distance`` elements (`PartitionedParameterCoordinator`). Without the largest
    module's size: every non-persistent parameter, capped by the live limit."""
    if largest_module_elements is None:
        return min(non_persistent, max_live_parameters)
    ahead = min(prefetch_bucket_size, max_live_parameters) + max_reuse_distance
    return min(non_persistent, largest_module_elements + ahead)


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
    offload: ZeroOffload = NO_OFFLOAD,
    accumulation_steps: int = 1,
    largest_module_elements: int | None = None,
    prefetch_bucket_size: int = 50_000_000,
    max_reuse_distance: int = 1_000_000_000,
) -> ZeroMemory:
    """Per-rank bytes for parameters given as `(elements, trainable)` pairs, in module order.

    `persistence_threshold` is ZeRO-3's ``stage3_param_persistence_threshold`` (parameters
    with at most that many elements stay whole on every rank); the bucket arguments are
    DeepSpeed's ``reduce_bucket_size``, ``contiguous_gradients`` and ``overlap_comm``;
    `max_live_parameters`, `prefetch_bucket_size` and `max_reuse_distance` are ZeRO-3's
    ``stage3_max_live_parameters``, ``stage3_prefetch_bucket_size`` and ``stage3_max_reuse_distance``,
    and `largest_module_elements` the most parameter elements one module owns directly (what
    ZeRO-3 fetches for one module; None: assume every parameter stays gathered).
    `offload` is ZeRO-Offload; `accumulation_steps` DeepSpeed's ``gradient_accumulation_steps``.
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
    if offload.optimizer and stage == 0 or offload.params and stage != 3:
        raise ValueError(
            f"stage={stage} with offload_optimizer={offload.optimizer_device!r}, offload_param={offload.param_device!r}: "
            "DeepSpeed offloads the optimizer at ZeRO stages 1-3 and the parameters at stage 3 only."
        )
    sizes: Sequence[tuple[int, bool]] = [(int(n), bool(t)) for n, t in params]
    if any(n < 0 for n, _ in sizes):
        raise ValueError("parameter sizes must be non-negative numbers of elements.")
    w = PARAM_ELEMENT_BYTES[precision]
    n_all = sum(n for n, _ in sizes)
    trainable = [n for n, t in sizes if t]
    n_train = sum(trainable)
    largest = max(trainable, default=0)
    bf16 = precision != "32-true"
    accumulating = accumulation_steps > 1

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
            step_transient_bytes=FP32 * n_train + 2 * FP32 * largest,
            buffer_bytes=buffer_bytes,
        )

    if stage in (1, 2):
        # Whole parameters in one flat buffer per group (`bit16_groups_flat`); the optimizer owns
        # this rank's fp32 partition of the flat trainable parameters (a copy even in fp32) and the
        # moments of that partition. Gradient partitions exist only from the end of the
        # backward to the end of the step.
        part = _partition(n_train, world_size)
        # Each backward allocates one contiguous bucket of `reduce_bucket_size` elements in
        # the gradients' dtype, two when communication overlaps the backward (`setup_buckets`);
        # offloading forces contiguous gradients on.
        contiguous = contiguous_gradients or offload.optimizer
        buckets = (2 if overlap_comm else 1) * reduce_bucket_size * w if contiguous and trainable else 0
        if not offload.optimizer:
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
        # ZeRO-Offload (`cpu_offload` in stage_1_and_2.py, for device cpu and nvme alike): the fp32
        # partition (`single_partition_of_fp32_groups`), its fp32 gradient (`.grad`, kept) and the
        # moments live in host memory, with a low-precision copy of the partition for the copy back
        # (`param_buffer_of_bit16_for_cpu_offload_groups`) and a one-parameter gradient buffer each
        # side (`temp_grad_buffer_for_cpu_offload` / `_for_gpu_offload`). Gradients go from the
        # bucket to the host partition as the backward makes them (stage 2, or stage 1 reducing
        # during the backward with `overlap_comm`); accumulating micro-batches adds
        # `accumulated_grads_in_cpu`, one low-precision copy of each gradient of the partition.
        return ZeroMemory(
            stage, world_size, precision,
            param_bytes=w * n_all,
            grad_bytes=0,
            master_bytes=0,
            optimizer_state_bytes=0,
            bucket_bytes=buckets,
            bucket_persistent=False,
            step_transient_bytes=FP32 * largest,  # one gradient cast to fp32 on its way to the host
            buffer_bytes=buffer_bytes,
            offload_buffer_bytes=w * largest,
            grads_on_device=stage == 1 and not overlap_comm,
            host_master_bytes=FP32 * part,
            host_grad_bytes=FP32 * part,
            host_optimizer_state_bytes=ADAM_MOMENTS * FP32 * part + STEP_COUNTER_BYTES,
            host_buffer_bytes=w * part + w * largest + (w * part if accumulating else 0),
        )

    # Stage 3: every parameter is split into equal per-rank partitions (trainable or not);
    # parameters up to `persistence_threshold` elements also stay whole on every rank.
    # Gradients are reduced into a flat partition buffer kept across steps
    # (`grad_partitions_flat_buffer`), and each gradient dtype has one contiguous bucket of
    # `reduce_bucket_size` elements.
    partitions = [_partition(n, world_size) for n, _ in sizes]
    parts = sum(partitions)
    persistent = sum(n for n, _ in sizes if n <= persistence_threshold)
    train_partitions = [_partition(n, world_size) for n in trainable]
    train_part = sum(train_partitions)
    largest_part = max(train_partitions, default=0)
    if world_size == 1 and not offload.params:
        gathered = 0  # one rank: a gathered parameter is its own partition, on the device already
    else:
        gathered = _gathered(n_all - persistent, max_live_parameters, largest_module_elements,
                             prefetch_bucket_size, max_reuse_distance)
    bucket = reduce_bucket_size * w if contiguous_gradients and trainable else 0
    moments = ADAM_MOMENTS * FP32 * train_part + STEP_COUNTER_BYTES
    # `offload_param` (`_create_param_groups_fp16_flat_cpu_memory`): the partitions live in host
    # memory, up to ``max_in_cpu`` elements under NVMe (the rest swapped out, through
    # ``buffer_count`` buffers of ``buffer_size`` elements); persistent parameters stay whole on the device.
    host_params = nvme_params = param_swap = 0
    if offload.params:
        host_params = w * (parts if offload.param_device == "cpu" else min(parts, offload.param_max_in_cpu_elements))
        nvme_params = w * parts - host_params
        if offload.param_device == "nvme":
            param_swap = w * offload.param_buffer_count * offload.param_buffer_elements
    device_params = w * persistent + (0 if offload.params else w * parts)
    if not offload.optimizer:
        return ZeroMemory(
            stage, world_size, precision,
            param_bytes=device_params,
            grad_bytes=w * train_part,
            master_bytes=FP32 * train_part,
            optimizer_state_bytes=moments,
            bucket_bytes=bucket,
            bucket_persistent=True,
            step_transient_bytes=2 * FP32 * train_part,
            gather_bytes=w * gathered,
            buffer_bytes=buffer_bytes,
            host_param_bytes=host_params,
            host_buffer_bytes=param_swap,
            nvme_bytes=nvme_params,
        )
    # `offload_optimizer`: the gradient partition buffer, the fp32 partitions of each sub-group
    # (`fp32_partitioned_groups_flat`), their fp32 gradients and the moments live in host memory;
    # with device nvme the fp32 partitions, gradients and moments are swapped out, through
    # ``buffer_count`` host buffers as large as the largest sub-group (`OptimizerSwapper`).
    # Each gradient partition reaches the host through a device copy cast to fp32.
    fp32_state = FP32 * train_part + FP32 * train_part + moments
    nvme = offload.optimizer_device == "nvme"
    swap = FP32 * offload.optimizer_buffer_count * _largest_sub_group(train_partitions, offload.sub_group_elements)
    return ZeroMemory(
        stage, world_size, precision,
        param_bytes=device_params,
        grad_bytes=0,
        master_bytes=0,
        optimizer_state_bytes=0,
        bucket_bytes=bucket,
        bucket_persistent=True,
        step_transient_bytes=(w + FP32) * largest_part,
        gather_bytes=w * gathered,
        buffer_bytes=buffer_bytes,
        grads_on_device=False,
        host_master_bytes=0 if nvme else FP32 * train_part,
        host_grad_bytes=0 if nvme else FP32 * train_part,
        host_optimizer_state_bytes=0 if nvme else moments,
        host_param_bytes=host_params,
        host_buffer_bytes=w * train_part + param_swap + (swap if nvme else 0),
        nvme_bytes=nvme_params + (fp32_state if nvme else 0),
    )


def zero_static_memory(params: Iterable[tuple[int, bool]], **kwargs) -> StaticMemory:
    """`zero_memory(...)` as the planner's `StaticMemory`."""
    return zero_memory(params, **kwargs).to_static_memory()
