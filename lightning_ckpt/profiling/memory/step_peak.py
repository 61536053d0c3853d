"""The one home for measuring a real peak: of a function, or of one training step.

The step runs in Lightning's order (forward and loss, `zero_grad`, backward,
optimizer step). On CPU the peak comes from `LiveBytesTracker` with parameters,
buffers, gradients and optimizer state and the batch adopted at the start; on CUDA from the
allocator's `max_memory_allocated`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.structure.batch import tensors_in
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker

__all__ = ["cuda_peak", "measure_peak", "measure_step_peak", "state_tensors"]


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """Every tensor that lives across steps: parameters, buffers, gradients, optimizer state."""
    out: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _step(model: nn.Module, loss_fn: Callable[[Any], torch.Tensor], batch: Any, optimizer) -> float:
    loss = loss_fn(batch)
    if optimizer is not None:
        optimizer.zero_grad()
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return float(loss.detach())


def measure_step_peak(
    model: nn.Module,
    loss_fn: Callable[[Any], torch.Tensor],
    batch: Any,
    optimizer: torch.optim.Optimizer | None = None,
) -> int:
    """Peak bytes of one whole training step (model state and the batch included)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return cuda_peak(lambda: _step(model, loss_fn, batch, optimizer), device)
    with LiveBytesTracker() as tracker:
        tracker.adopt(state_tensors(model, optimizer) + list(tensors_in(batch)))
        tracker.reset_peak()
        _step(model, loss_fn, batch, optimizer)
    return tracker.peak_bytes


def measure_peak(fn: Callable[[], Any], baseline_bytes: int = 0) -> int:
    """Peak live bytes while running `fn()` (plus a constant baseline)."""
    with LiveBytesTracker() as tracker:
        fn()
    return baseline_bytes + tracker.peak_bytes


def cuda_peak(fn: Callable[[], Any], device: torch.device | None = None) -> int:
    """Peak allocated CUDA bytes while running `fn()` (the allocator's own counter)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))
