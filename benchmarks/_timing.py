"""What the plan benchmarks share: a model ready to step, one plan to measure, and the
interleaved timing of plans.

`time_variants` visits every plan once per round in a rotated order, applies it, runs one
untimed warm-up step and then timed steps, and removes it; a plan's time is the median of its
timed steps (`plans.py`, `recompute_check.py`). `time_rounds` does the same for settings that each
step a model of their own (`step_cost.py`, `peers.py`), keeping each round's steps on both clocks.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt import measure_step_peak
from lightning_ckpt.apply.segments import apply_segments


@dataclass
class Case:
    """One example model, ready to step: the chain of blocks, a batch and its optimizer."""

    name: str
    model: torch.nn.Module
    names: list[str]
    blocks: list[torch.nn.Module]
    batch: Any
    loss_fn: Callable[[Any], torch.Tensor]
    optimizer: torch.optim.Optimizer
    batch_size: int
    activation_budgets: bool = False  # also plan at 16 B/param + ACTIVATION_SHARES of the activations


@dataclass
class Variant:
    """One distinct plan (segments) with what was measured for it."""

    label: str
    segments: tuple
    keeps: tuple = ()  # (block, kept op calls) of an op-level plan
    inner: tuple = ()  # inner segments of a multi-level plan
    measured_peak: int = 0
    step_flops: int = 0
    times: list[float] = field(default_factory=list)  # on the chosen clock
    other_times: list[float] = field(default_factory=list)  # on the other clock, for the noise line

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)


def step(case: Case) -> None:
    """One training step in Lightning's order: forward and loss, zero_grad, backward, step."""
    loss = case.loss_fn(case.batch)
    case.optimizer.zero_grad()
    loss.backward()
    case.optimizer.step()


def measure_variant(case: Case, v: Variant) -> None:
    """Tracker peak and total FLOPs of one step under the plan (once: the tracker is slow)."""
    handle = apply_segments(case.blocks, v.segments, keep_ops=dict(v.keeps), inner_segments=v.inner)
    try:
        v.measured_peak = measure_step_peak(case.model, case.loss_fn, case.batch, case.optimizer)
        # A separate step: FlopCounterMode's module tracking holds on to tensors, so
        # under it the tracker would see checkpointed activations stay alive.
        with FlopCounterMode(display=False) as counter:
            step(case)
        v.step_flops = int(counter.get_total_flops())
    finally:
        handle.remove()


def time_variants(case: Case, variants: list[Variant], repeats: int, steps: int, clock: str) -> None:
    """Round-robin over the variants, `repeats` times, rotating the order each time.

    `clock="cpu"` times a step by this process's CPU time, `"wall"` by the wall clock.
    With one thread they agree on an idle machine; when other processes share the
    cores, CPU time leaves out the time this process waited for one.
    """
    for r in range(repeats):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            handle = apply_segments(case.blocks, v.segments, keep_ops=dict(v.keeps), inner_segments=v.inner)
            try:
                gc.collect()
                step(case)  # warm-up: hooks installed, allocator settled
                for _ in range(steps):
                    w0, c0 = time.perf_counter(), time.process_time()
                    step(case)
                    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                    v.times.append(cpu if clock == "cpu" else wall)
                    v.other_times.append(wall if clock == "cpu" else cpu)
            finally:
                handle.remove()


@dataclass
class Timed:
    """One setting timed by `time_rounds`: a no-argument training step of its own model and
    optimizer, and per round the times of its timed steps on both clocks."""

    label: str
    step: Callable[[], None]
    cpu_s: list[list[float]] = field(default_factory=list)
    wall_s: list[list[float]] = field(default_factory=list)

    def rounds(self, clock: str) -> list[float]:
        """The median of each round's timed steps on `clock` ("cpu" or "wall")."""
        return [statistics.median(r) for r in (self.cpu_s if clock == "cpu" else self.wall_s)]

    def median_s(self, clock: str) -> float:
        return statistics.median(t for r in (self.cpu_s if clock == "cpu" else self.wall_s) for t in r)


def time_rounds(entries: list[Timed], repeats: int, steps: int) -> None:
    """`repeats` rounds over `entries` in an order rotated by one each round; each visit runs one
    untimed warm-up step, then `steps` steps timed by process CPU time and by the wall clock."""
    for r in range(repeats):
        k = r % len(entries)
        for e in entries[k:] + entries[:k]:
            gc.collect()
            e.step()  # warm-up: caches and the allocator settled after the other settings' steps
            cpu, wall = [], []
            for _ in range(steps):
                w0, c0 = time.perf_counter(), time.process_time()
                e.step()
                wall.append(time.perf_counter() - w0)
                cpu.append(time.process_time() - c0)
            e.cpu_s.append(cpu)
            e.wall_s.append(wall)


def round_ratios(a: Timed, b: Timed, clock: str) -> list[float]:
    """Per round, `a`'s median step over `b`'s: both ran in the same round, minutes apart at most."""
    return [x / y for x, y in zip(a.rounds(clock), b.rounds(clock))]
