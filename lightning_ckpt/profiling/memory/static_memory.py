"""Memory that does not depend on the batch: parameters, buffers, gradients, optimizer state.

`StaticMemory` is what stays on the training device; a strategy that offloads (ZeRO-Offload,
FSDP2's `CPUOffloadPolicy`) says beside it what lives in host memory and on NVMe.

Counted from the live objects where they exist; the optimizer's state is estimated
from its type before its first step (Adam keeps two moments per parameter, SGD
with momentum one buffer, ...), since most optimizers create it lazily. Every size is what
this process holds: a DTensor parameter (tensor parallelism) by its local shard
(`tp_memory.local_nbytes`), and so its optimizer state and gradient (an existing gradient by
the storage it keeps: `tp_memory.grad_held_bytes`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ckpt.profiling.memory.tp_memory import grad_held_bytes, local_nbytes
from lightning_ckpt.profiling.memory.tracker import unique_storage_bytes


@dataclass(frozen=True)
class StaticMemory:
    """Per-device bytes that do not depend on the batch (every `_bytes` field is device memory but
    `host_parts` and `nvme_bytes`).

    grads_on_device: False when the strategy moves each parameter gradient off the device as the
        backward makes it (ZeRO-Offload, FSDP2's CPU offloading): the profile's parameter gradients
        then do not build up on the device (`StepCost.grads_on_device`).
    host_parts: (what, bytes) the strategy keeps in host memory for this rank (offloaded master
        weights, gradients, optimizer state, parameter partitions, copy buffers); checked against
        the host budget, not the device's.
    nvme_bytes: what it swaps out to NVMe.
    """

    param_bytes: int
    buffer_bytes: int
    grad_bytes: int  # gradients of trainable parameters, when all exist
    optimizer_state_bytes: int
    optimizer_transient_bytes: int  # scratch of one optimizer step
    comm_buffer_bytes: int = 0  # a strategy's communication buffers, e.g. DDP's gradient buckets (`ddp_memory`)
    grads_on_device: bool = True
    host_parts: tuple[tuple[str, int], ...] = ()
    nvme_bytes: int = 0

    @property
    def resident_bytes(self) -> int:
        """What stays allocated all step (gradients come and go: modelled separately)."""
        return self.param_bytes + self.buffer_bytes + self.optimizer_state_bytes + self.comm_buffer_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes kept in host memory for this rank (0 without offloading)."""
        return sum(n for _, n in self.host_parts)


# optimizers whose state is sized from their type before it exists (`optimizer_state_bytes`)
KNOWN_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad)


def _trainable(params) -> list[torch.Tensor]:
    return [p for p in params if p.requires_grad]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state; estimated from its type before its first step."""
    existing = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if existing:
        return unique_storage_bytes(existing)
    total = 0
    for group in optimizer.param_groups:
        params = _trainable(group["params"])
        nbytes = sum(local_nbytes(p) for p in params)
        per_param_scalar = 4 * len(params)  # Adam-style `step` tensors
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            total += nbytes * (3 if group.get("amsgrad") else 2) + per_param_scalar
        elif isinstance(optimizer, torch.optim.SGD):
            total += nbytes if group.get("momentum", 0) else 0
        elif isinstance(optimizer, torch.optim.RMSprop):
            total += nbytes * (1 + bool(group.get("momentum", 0)) + bool(group.get("centered")))
        elif isinstance(optimizer, torch.optim.Adagrad):
            total += nbytes + per_param_scalar
        else:
            warnings.warn(
                f"lightning-ckpt does not know how much state {type(optimizer).__name__} keeps before its first step; "
                "assuming two tensors per parameter (like Adam). The plan is checked against the budget with that guess.",
                stacklevel=2,
            )
            total += 2 * nbytes
    return total


def optimizer_transient_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Scratch of one step: per-parameter temporaries, or whole lists with `foreach`."""
    params = [p for g in optimizer.param_groups for p in _trainable(g["params"])]
    if not params:
        return 0
    foreach = any(g.get("foreach") for g in optimizer.param_groups) or all(p.is_cuda for p in params)
    if foreach:
        return sum(local_nbytes(p) for p in params)
    return 2 * max(local_nbytes(p) for p in params)


def static_memory(model: nn.Module, optimizers: list[torch.optim.Optimizer] | tuple = ()) -> StaticMemory:
    params = list(model.parameters())
    return StaticMemory(
        param_bytes=unique_storage_bytes(params),
        buffer_bytes=unique_storage_bytes(model.buffers()),
        grad_bytes=sum(grad_held_bytes(params).values()),  # (as the gradients that exist hold them)
        optimizer_state_bytes=sum(optimizer_state_bytes(o) for o in optimizers),
        optimizer_transient_bytes=max((optimizer_transient_bytes(o) for o in optimizers), default=0),
    )
