"""`DeepSpeedStrategy`: Lightning's DeepSpeed strategy, also on CPU, that informs the planner.

On CUDA it is Lightning's, unchanged; on the CPU accelerator (`DS_ACCELERATOR=cpu`, gloo) it skips Lightning's
three CUDA-only steps. It gives `ActivationCheckpointing` the per-rank static memory of the ZeRO stage (under
ZeRO-Offload: what stays on the device, and what lives in host memory and on NVMe), the tensors it keeps in
host memory (left out of a measured device peak), and a profiling context that pauses DeepSpeed's gradient
hooks and keeps ZeRO-3's parameter gathers out of the profile.
The only module of lightning-ckpt importing `deepspeed`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import (
    DeepSpeedStrategy as _LightningDeepSpeedStrategy,
)
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_ckpt.profiling.memory.static_memory import StaticMemory
from lightning_ckpt.profiling.memory.zero_memory import PRECISIONS, ZeroMemory, ZeroOffload, zero_memory

__all__ = ["DeepSpeedStrategy"]

# DeepSpeed's own default for `stage3_param_persistence_threshold` (elements): ZeRO-3
# keeps parameters this small whole on every rank instead of partitioning them.
DEEPSPEED_PERSISTENCE_DEFAULT = 100_000
DEEPSPEED_REDUCE_BUCKET_DEFAULT = 500_000_000  # DeepSpeed's default `reduce_bucket_size` (elements)
DEEPSPEED_MAX_LIVE_DEFAULT = 1_000_000_000  # DeepSpeed's default `stage3_max_live_parameters` (elements)
DEEPSPEED_PREFETCH_DEFAULT = 50_000_000  # DeepSpeed's default `stage3_prefetch_bucket_size` (elements)
DEEPSPEED_REUSE_DEFAULT = 1_000_000_000  # DeepSpeed's default `stage3_max_reuse_distance` (elements)


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "lightning_ckpt.DeepSpeedStrategy needs DeepSpeed, which is not installed. "
            "Install it with `pip install 'lightning-ckpt[deepspeed]'` (or `pip install deepspeed`)."
        ) from err
    return deepspeed


class DeepSpeedStrategy(_LightningDeepSpeedStrategy):
    """Lightning's `DeepSpeedStrategy`, also on the CPU accelerator, with lightning-ckpt's hooks.

    Takes every argument of Lightning's `DeepSpeedStrategy`, plus:

    Args:
        param_persistence_threshold: ZeRO-3 only: parameters of at most this many elements stay
            whole on every rank (DeepSpeed's ``stage3_param_persistence_threshold``; its default is
            100000). None keeps the config's value.
    """

    def __init__(self, *args: Any, param_persistence_threshold: int | None = None, **kwargs: Any) -> None:
        if param_persistence_threshold is not None and (
            isinstance(param_persistence_threshold, bool)
            or not isinstance(param_persistence_threshold, int)
            or param_persistence_threshold < 0
        ):
            raise ValueError(
                f"param_persistence_threshold={param_persistence_threshold!r} must be a non-negative integer (a "
                "number of elements), or None to keep DeepSpeed's default."
            )
        super().__init__(*args, **kwargs)
        self.param_persistence_threshold = param_persistence_threshold
        if param_persistence_threshold is not None:
            zero = self.config.get("zero_optimization")
            if not isinstance(zero, dict):
                raise ValueError(
                    f"param_persistence_threshold={param_persistence_threshold} applies to ZeRO stage 3, but the "
                    "DeepSpeed config has no zero_optimization section; set stage=3 or drop the argument."
                )
            zero["stage3_param_persistence_threshold"] = param_persistence_threshold

    # ------------------------------------------------------------------ CPU support
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    @override
    def setup_environment(self) -> None:
        if not self._on_cpu():
            super().setup_environment()  # Lightning's, which requires CUDA
            return
        deepspeed = _import_deepspeed()
        name = deepspeed.get_accelerator().device_name()
        if name != "cpu":
            raise RuntimeError(
                f"the Trainer runs on the CPU accelerator but DeepSpeed picked its {name!r} accelerator; both must "
                "agree. Set the environment variable DS_ACCELERATOR=cpu before starting Python, or train on CUDA."
            )
        DDPStrategy.setup_environment(self)  # skips Lightning's CUDA-only check

    @override
    def setup_distributed(self) -> None:
        if not self._on_cpu():
            super().setup_distributed()
            return
        # Lightning's version checks that device indices equal local ranks; CPU devices have no index.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @contextlib.contextmanager
    def _cpu_device_rank(self) -> Iterator[None]:
        """Lightning passes `device_rank=root_device.index` to `deepspeed.initialize`; a CPU device's
        index is None, which DeepSpeed cannot use. On CPU the local rank is passed instead."""
        if not self._on_cpu():
            yield
            return
        deepspeed = _import_deepspeed()
        original = deepspeed.initialize
        local_rank = self.local_rank

        def initialize(*args: Any, **kwargs: Any) -> Any:
            ns = kwargs.get("args")
            if ns is not None and getattr(ns, "device_rank", 0) is None:
                ns.device_rank = local_rank
            return original(*args, **kwargs)

        deepspeed.initialize = initialize
        try:
            yield
        finally:
            deepspeed.initialize = original

    @override
    def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        with self._cpu_device_rank():
            return super()._setup_model_and_optimizer(*args, **kwargs)

    @override
    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        with self._cpu_device_rank():
            super()._initialize_deepspeed_inference(model)

    # ------------------------------------------------------------------ lightning-ckpt hooks
    @property
    def zero_stage(self) -> int:
        """The configured ZeRO stage (0 when ZeRO is off)."""
        zero = (self.config or {}).get("zero_optimization") or {}
        return int(zero.get("stage", 0))

    def zero_memory(self, pl_module: nn.Module) -> ZeroMemory:
        """Per-rank bytes by kind (parameters, gradients, master weights, moments, buckets)."""
        precision = self.precision_plugin.precision
        if precision not in PRECISIONS:
            raise ValueError(
                f"lightning-ckpt models DeepSpeed's memory for precision {', '.join(PRECISIONS)}, not {precision!r}; "
                "train with one of those, or set the callback's memory_budget knowing the model state is not counted."
            )
        config = self.config or {}
        zero = config.get("zero_optimization") or {}
        if (config.get("data_types") or {}).get("grad_accum_dtype") not in (None, "bf16" if "bf16" in precision else "fp32"):
            rank_zero_warn(
                "lightning-ckpt's ZeRO memory model assumes gradients accumulate in the parameters' dtype; the "
                "config's data_types.grad_accum_dtype differs, so the static memory in the plan is approximate."
            )
        stage = self.zero_stage
        return zero_memory(
            _param_sizes(pl_module),
            stage=stage,
            world_size=self.world_size,
            precision=precision,
            persistence_threshold=_number(zero, "stage3_param_persistence_threshold", DEEPSPEED_PERSISTENCE_DEFAULT),
            reduce_bucket_size=_number(zero, "reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET_DEFAULT),
            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
            overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
            max_live_parameters=_number(zero, "stage3_max_live_parameters", DEEPSPEED_MAX_LIVE_DEFAULT),
            buffer_bytes=sum(b.numel() * b.element_size() for b in pl_module.buffers()),
            offload=_offload(zero),
            accumulation_steps=_number(config, "gradient_accumulation_steps", 1),
            largest_module_elements=_largest_module(pl_module),
            prefetch_bucket_size=_number(zero, "stage3_prefetch_bucket_size", DEEPSPEED_PREFETCH_DEFAULT),
            max_reuse_distance=_number(zero, "stage3_max_reuse_distance", DEEPSPEED_REUSE_DEFAULT),
        )

    def ckpt_static_memory(self, pl_module: nn.Module, optimizers: Any = ()) -> StaticMemory:
        """Per-rank static memory for `ActivationCheckpointing`: the ZeRO model, not what this
        process happens to hold (under ZeRO-3 the parameters are partitioned and empty here)."""
        return self.zero_memory(pl_module).to_static_memory()

    def ckpt_host_tensors(self) -> list[torch.Tensor]:
        """The tensors ZeRO-Offload keeps in host memory (none without offloading): a device peak
        measured on a CPU-only machine leaves them out, as the device does on CUDA. Read off
        DeepSpeed's optimizer: the fp32 partitions and their gradients, the moments, the copy
        buffers and, under ``offload_param``, the parameter partitions."""
        zero = (self.config or {}).get("zero_optimization") or {}
        offload = _offload(zero)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not (offload.optimizer or offload.params):
            return []
        found: list[torch.Tensor] = []
        names = _HOST_OPTIMIZER if offload.optimizer else ()
        names += _HOST_PARAMS if offload.params else ()
        for name in names:
            _tensors_in(getattr(optimizer, name, None), found)
        found += [t.grad for t in found if t.grad is not None]
        if offload.optimizer:
            for state in getattr(optimizer, "state", {}).values():
                found += [v for v in state.values() if isinstance(v, torch.Tensor)]
        if offload.params:
            found += [p.ds_tensor for p in self.lightning_module.parameters() if getattr(p, "ds_tensor", None) is not None]
        return found

    @contextlib.contextmanager
    def ckpt_profiling_context(self) -> Iterator[None]:
        """Profiling steps run forward and backward outside DeepSpeed's engine: pause the
        gradient hooks DeepSpeed put on the parameters (`_paused_gradient_hooks`) and, under
        ZeRO-3, keep its parameter gathering out of the profile (`_unseen_parameter_gathers`)."""
        with self._paused_gradient_hooks(), self._unseen_parameter_gathers():
            yield

    @contextlib.contextmanager
    def _paused_gradient_hooks(self) -> Iterator[None]:
        """Pause the gradient hooks DeepSpeed put on the parameters (they would reduce and
        partition the profiling gradients into its buffers), and restore them afterwards."""
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        stash = []
        for p in params:
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if hooks:
                stash.append((hooks, dict(hooks)))
                hooks.clear()
        try:
            yield
        finally:
            for hooks, saved in stash:
                hooks.update(saved)

    @contextlib.contextmanager
    def _unseen_parameter_gathers(self) -> Iterator[None]:
        """ZeRO-3: run DeepSpeed's parameter fetches and releases with the dispatch modes that
        profile the step switched off. The gathered parameters are the static memory's
        `ZeroMemory.gather_bytes`; seen by the profile they were counted again as activations:
        with a complete trace DeepSpeed gathers every parameter after the first module's, in one
        flat buffer that lives until the last of them is used, and copies each parameter out of
        it, all before the first block (`pre_saved_bytes`, resident all step in the memory model).
        Without a trace the gathers land in each block's scratch instead. No-op below stage 3."""
        coordinator = _param_coordinator(self.model)
        if coordinator is None:
            yield
            return
        from torch.utils._python_dispatch import _disable_current_modes

        def unseen(method: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                with _disable_current_modes():
                    return method(*args, **kwargs)

            return call

        names = [n for n in _COORDINATOR_GATHERS if hasattr(coordinator, n)]
        for name in names:  # an instance attribute: DeepSpeed's hooks look the method up at each call
            setattr(coordinator, name, unseen(getattr(coordinator, name)))
        try:
            yield
        finally:
            for name in names:
                vars(coordinator).pop(name, None)


# The methods of DeepSpeed's ZeRO-3 `PartitionedParameterCoordinator` that all-gather, copy out
# or free parameters (`reset_step` and `release_and_reset_all` wait on prefetches still in flight).
_COORDINATOR_GATHERS = (
    "fetch_sub_module", "release_sub_module", "reset_step", "release_and_reset_all", "release_backward_leftovers",
)


def _param_coordinator(engine: Any) -> Any:
    """DeepSpeed's ZeRO-3 parameter coordinator of `engine` (held by the stage-3 optimizer, or by
    the engine's `DeepSpeedZeRoOffload` when it trains without one); None below stage 3 or
    before `deepspeed.initialize`."""
    holder = getattr(engine, "optimizer", None)
    holder = getattr(holder, "parameter_offload", holder)
    get = getattr(holder, "get_param_coordinator", None)
    return get() if callable(get) else None


# DeepSpeed optimizer attributes holding host tensors under `offload_optimizer` (stage_1_and_2.py: the fp32
# partition, the low-precision copy of it, the gradient buffer and the accumulated gradients; stage3.py: the
# fp32 partitions and the low-precision gradient partition) and under `offload_param` (its flat partitions).
_HOST_OPTIMIZER = (
    "single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
    "temp_grad_buffer_for_cpu_offload", "accumulated_grads_in_cpu", "fp32_partitioned_groups_flat",
    "grad_partitions_flat_buffer",
)
_HOST_PARAMS = ("param_groups_fp16_flat_cpu_memory",)


def _tensors_in(value: Any, out: list[torch.Tensor]) -> None:
    """Append the tensors in `value`, through lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, out)


def _offload(zero: dict) -> ZeroOffload:
    """ZeRO-Offload as the config's ``offload_optimizer`` and ``offload_param`` sections set it
    (DeepSpeed's defaults for what they leave out)."""
    opt = zero.get("offload_optimizer") or {}
    par = zero.get("offload_param") or {}
    opt = opt if isinstance(opt, dict) else {"device": "cpu"}  # `offload_optimizer: true`
    par = par if isinstance(par, dict) else {"device": "cpu"}
    default = ZeroOffload()
    return ZeroOffload(
        optimizer_device=str(opt.get("device") or "none"),
        param_device=str(par.get("device") or "none"),
        optimizer_buffer_count=_number(opt, "buffer_count", default.optimizer_buffer_count),
        param_buffer_count=_number(par, "buffer_count", default.param_buffer_count),
        param_buffer_elements=_number(par, "buffer_size", default.param_buffer_elements),
        param_max_in_cpu_elements=_number(par, "max_in_cpu", default.param_max_in_cpu_elements),
        sub_group_elements=_number(zero, "sub_group_size", default.sub_group_elements),
    )


def _largest_module(module: nn.Module) -> int:
    """The most parameter elements one module owns directly (what ZeRO-3 fetches before it runs)."""
    return max(
        (sum(int(getattr(p, "ds_numel", p.numel())) for p in m.parameters(recurse=False)) for m in module.modules()),
        default=0,
    )


def _param_sizes(module: nn.Module) -> list[tuple[int, bool]]:
    """(elements, trainable) of every parameter; ZeRO-3 partitioned ones report `ds_numel`."""
    out = []
    for p in module.parameters():
        n = getattr(p, "ds_numel", None)
        out.append((int(n) if n is not None else p.numel(), p.requires_grad))
    return out


def _number(zero: dict, key: str, default: int) -> int:
    """A size from the ZeRO config; DeepSpeed's default when absent or not a number (e.g. "auto")."""
    value = zero.get(key, default)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
