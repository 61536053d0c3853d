"""Plain forwards over the probed blocks, without autograd: what a block holds in flight when it
saves nothing (as inside a checkpointed segment) and how long each block's forward takes.

`probe_step` runs both after its measured step, with model state preserved around them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.structure.block_calls import CallSites, hook_calls
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker

__all__ = ["nosave_forward_peaks", "time_blocks"]

StepFn = Callable[[Any], torch.Tensor]


def nosave_forward_peaks(blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any) -> list[int]:
    """Per block, the peak bytes above those live at its entry during a forward that
    saves nothing for backward, as a block inside a checkpointed segment runs: each
    intermediate lives only until the next op has consumed it. Measured in a forward
    without grad under the live-bytes tracker."""
    peaks = [0] * len(blocks)
    entry = [0] * len(blocks)
    tracker = LiveBytesTracker()

    def pre(i, module, args):
        entry[i] = tracker.live_bytes
        tracker.reset_peak()

    def post(i, module, args, out):
        peaks[i] = max(0, tracker.peak_bytes - entry[i])

    handles = hook_calls(CallSites(blocks, grad_only=False), pre, post)  # every call counts: no grad here
    try:
        with torch.no_grad(), tracker:
            step_fn(batch)
    finally:
        for h in handles:
            h.remove()
    return peaks


def time_blocks(model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any) -> list[float]:
    """Forward wall time of each block (ms), measured in a plain forward without grad."""
    times = [0.0] * len(blocks)
    starts = [0.0] * len(blocks)

    def pre(i, module, args):
        starts[i] = time.perf_counter()

    def post(i, module, args, out):
        times[i] = (time.perf_counter() - starts[i]) * 1e3

    handles = hook_calls(CallSites(blocks, grad_only=False), pre, post)
    try:
        with torch.no_grad():
            step_fn(batch)
    finally:
        for h in handles:
            h.remove()
    return times
