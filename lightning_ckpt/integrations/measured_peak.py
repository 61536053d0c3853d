"""The measured peak of one training step, read between Lightning's batch-start and batch-end hooks.

`step_peak` is a context manager: entered when a step starts, closed when it ends, the
`PeakReading` it yields then holds the step's peak. On CUDA the allocator's counter is
read; on CPU a `LiveBytesTracker` counts every tensor, starting from the model state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from lightning_ckpt.profiling.step_peak import state_tensors
from lightning_ckpt.profiling.tracker import LiveBytesTracker


@dataclass
class PeakReading:
    """Filled when the measuring context closes."""

    peak_bytes: int | None = None


def should_measure(trainer: pl.Trainer, measure_peak: bool | None) -> bool:
    """Whether to measure the step about to run: asked for (None: on CUDA, where it is free) and
    steady, i.e. the optimizer state the plan counts exists already."""
    wanted = measure_peak if measure_peak is not None else trainer.strategy.root_device.type == "cuda"
    return wanted and (any(len(o.state) for o in trainer.optimizers) or not trainer.optimizers)


@contextlib.contextmanager
def step_peak(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[PeakReading]:
    """Measure the peak bytes of what runs inside: parameters, buffers, gradients, optimizer
    state and everything the step allocates."""
    reading = PeakReading()
    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield reading
        reading.peak_bytes = int(torch.cuda.max_memory_allocated(device))
        return
    optimizer_state = [
        t for o in trainer.optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    with LiveBytesTracker() as tracker:
        tracker.adopt(state_tensors(pl_module, None) + optimizer_state)
        tracker.reset_peak()
        yield reading
    reading.peak_bytes = tracker.peak_bytes
