"""What the training strategy tells the callback: per-device static memory and a profiling context.

A strategy may define `ckpt_static_memory(pl_module, optimizers)` (ZeRO shards the model state),
`ckpt_host_tensors()` (what ZeRO-Offload keeps in host memory) and `ckpt_profiling_context()` (DeepSpeed
pauses its gradient hooks); else FSDP2's model for `fully_shard`-ed
modules or what this process holds, plus DDP's gradient buckets when DDP wraps the model (`ddp_memory`),
and under DDP profiling inside `no_sync`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from lightning_ckpt.profiling.memory.ddp_memory import ddp_comm_buffer_bytes
from lightning_ckpt.profiling.memory.fsdp_memory import fsdp_host_tensors, model_fsdp_memory
from lightning_ckpt.profiling.memory.static_memory import StaticMemory, static_memory

if TYPE_CHECKING:  # only for the annotations: importing Lightning costs seconds
    import lightning.pytorch as pl


def strategy_static_memory(trainer: pl.Trainer, pl_module: pl.LightningModule) -> StaticMemory:
    """Per-device static memory: the strategy's own model when it has one, else what this process holds
    (with DDP's gradient buckets, allocated when DDP wrapped the module)."""
    own = getattr(trainer.strategy, "ckpt_static_memory", None)
    if callable(own):
        return own(pl_module, trainer.optimizers)
    fsdp = model_fsdp_memory(pl_module)  # FSDP2 (`fully_shard`, e.g. under ModelParallelStrategy)
    if fsdp is not None:
        return fsdp.to_static_memory()
    static = static_memory(pl_module, trainer.optimizers)
    buckets = ddp_comm_buffer_bytes(getattr(trainer, "model", None))
    return dataclasses.replace(static, comm_buffer_bytes=buckets) if buckets else static


def strategy_host_tensors(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
    """The tensors the strategy keeps in host memory, not on the device (ZeRO-Offload; FSDP2's
    `CPUOffloadPolicy`): a device peak measured where the device is the CPU leaves them out."""
    own = getattr(trainer.strategy, "ckpt_host_tensors", None)
    if callable(own):
        return list(own())
    return fsdp_host_tensors(pl_module, trainer.optimizers)


def profiling_context(trainer: pl.Trainer) -> contextlib.AbstractContextManager[Any]:
    """The strategy's context for profiling steps (DDP: no gradient sync)."""
    own = getattr(trainer.strategy, "ckpt_profiling_context", None)
    if callable(own):
        return own()
    no_sync = getattr(trainer.model, "no_sync", None)
    return no_sync() if callable(no_sync) else contextlib.nullcontext()
