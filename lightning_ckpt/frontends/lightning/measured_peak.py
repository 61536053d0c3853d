"""The memory of a fit as the OS or the GPU sees it: the allocator setting, and the measured peak
of one training step, read between Lightning's batch-start and batch-end hooks.

`fit_memory` sets the allocator at fit start and takes the RSS baseline; `step_peak` is a context
manager whose `PeakReading` holds, once closed, the tracked peak and the RSS peak above that
baseline (CPU) or `max_memory_allocated` and `max_memory_reserved` (CUDA); `report` logs them and
says loudly when the engine judged the step over the budget (`engine.measured_steps`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ckpt.engine.measured_steps import MeasuredStep
from lightning_ckpt.frontends.lightning.loggers import log_metrics
from lightning_ckpt.frontends.lightning.strategy_hooks import strategy_host_tensors
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.units import format_bytes
from lightning_ckpt.profiling.memory.allocator import AllocatorSetting, follow_tensors
from lightning_ckpt.profiling.structure.batch import tensors_in
from lightning_ckpt.profiling.memory.rss import RssPeak, current_anon_bytes, current_rss_bytes
from lightning_ckpt.profiling.memory.step_peak import state_tensors
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker
from lightning_ckpt.report.files import REPORT_JSON, write_whole


@dataclass(frozen=True)
class FitMemory:
    """What `fit_memory` did at fit start: the allocator setting and the RSS then (CPU, Linux)."""

    allocator: AllocatorSetting
    rss_start_bytes: int | None
    anon_start_bytes: int | None = None

    def restore(self) -> None:
        self.allocator.restore()


def fit_memory(trainer: pl.Trainer, tune_allocator: bool | None = None) -> FitMemory:
    """Set the allocator of the training device as `tune_allocator` asks (`allocator.follow_tensors`:
    None sets CUDA's and leaves CPU malloc alone; one info line says what was set), then read the
    RSS baseline."""
    device = trainer.strategy.root_device
    setting = follow_tensors(device.type, tune_allocator)
    if setting.message:
        rank_zero_info(setting.message)
    if device.type != "cpu":
        return FitMemory(setting, None)
    return FitMemory(setting, current_rss_bytes(), current_anon_bytes())


@dataclass
class PeakReading:
    """Filled when the measuring context closes.

    peak_bytes: tracked live bytes (CPU) or `max_memory_allocated` (CUDA), the whole step.
    rss_peak_bytes: CPU: the process's RSS peak in the step minus its RSS at fit start.
    rss_anon_peak_bytes: the same for anonymous memory (heap and tensors; library code that
        first calls page in left out).
    reserved_peak_bytes: CUDA: `max_memory_reserved`, what the caching allocator held.
    """

    peak_bytes: int | None = None
    rss_peak_bytes: int | None = None
    rss_anon_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None

    @property
    def what(self) -> str:
        """What `peak_bytes` counts, for messages."""
        return "max allocated" if self.reserved_peak_bytes is not None else "tracked tensors"

    def to_dict(self) -> dict[str, int | None]:
        return {
            "tracked_peak_bytes": self.peak_bytes,
            "rss_peak_above_start_bytes": self.rss_peak_bytes,
            "rss_anon_peak_above_start_bytes": self.rss_anon_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
        }


def should_measure(trainer: pl.Trainer, measure_peak: bool) -> bool:
    """Whether to measure the step about to run: asked for (`measure_peak`, on by default) and steady,
    i.e. the optimizer state the plan counts exists already."""
    return measure_peak and (any(len(o.state) for o in trainer.optimizers) or not trainer.optimizers)


@contextlib.contextmanager
def step_peak(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any = None, fit: FitMemory | None = None,
    tracker: type[LiveBytesTracker] = LiveBytesTracker,
) -> Iterator[PeakReading]:
    """Measure the peak bytes of what runs inside: parameters, buffers, gradients, optimizer
    state, the batch and everything the step allocates, less what the strategy keeps in host memory
    (`strategy_hooks.strategy_host_tensors`); on CPU also the process's RSS above
    `fit.rss_start_bytes` (without `fit`, above its value on entry). On CPU `tracker` counts the
    tensors (the callback's own measurement passes the cheaper `StepBytesTracker`)."""
    reading = PeakReading()
    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield reading
        torch.cuda.synchronize(device)
        reading.peak_bytes = int(torch.cuda.max_memory_allocated(device))
        reading.reserved_peak_bytes = int(torch.cuda.max_memory_reserved(device))
        return
    optimizer_state = [
        t for o in trainer.optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    rss_start = current_rss_bytes() if fit is None else fit.rss_start_bytes
    anon_start = current_anon_bytes() if fit is None else fit.anon_start_bytes
    with RssPeak() as rss, tracker() as tracked:
        tracked.ignore(strategy_host_tensors(trainer, pl_module))  # offloaded: in host memory, not the device's
        tracked.adopt(state_tensors(pl_module, None) + optimizer_state + list(tensors_in(batch)))
        tracked.reset_peak()
        yield reading
    reading.peak_bytes = tracked.peak_bytes
    if rss.peak_bytes is not None and rss_start is not None:
        reading.rss_peak_bytes = rss.peak_bytes - rss_start
    if rss.anon_peak_bytes is not None and anon_start is not None:
        reading.rss_anon_peak_bytes = rss.anon_peak_bytes - anon_start


def summary(reading: PeakReading, plan: Plan, shape: str | None = None, verdict: MeasuredStep | None = None) -> str:
    """One line: the prediction, the budget (the user's, with what is held in reserve) and each measured figure."""
    budget = format_bytes(plan.budget_bytes) if plan.budget_bytes is not None else "none"
    if verdict is not None:
        budget = format_bytes(verdict.budget_bytes)
        budget += f", {format_bytes(verdict.reserve_bytes)} of it held in reserve" if verdict.reserve_bytes else ""
    parts = [f"predicted {format_bytes(plan.predicted_peak_bytes)} (budget {budget})"]
    if reading.reserved_peak_bytes is not None:
        parts += [f"max allocated {format_bytes(reading.peak_bytes)}", f"max reserved {format_bytes(reading.reserved_peak_bytes)}"]
    else:
        parts.append(f"tracked tensors {format_bytes(reading.peak_bytes)}")
        if reading.rss_peak_bytes is not None:
            parts.append(f"process RSS above fit start {format_bytes(reading.rss_peak_bytes)}")
        if reading.rss_anon_peak_bytes is not None:
            parts.append(f"of it anonymous (heap, tensors) {format_bytes(reading.rss_anon_peak_bytes)}")
    where = f"first planned step at shape ({shape})" if shape else "first planned step"
    return f"lightning-ckpt: {where}: " + ", ".join(parts)


def report(
    trainer: pl.Trainer, reading: PeakReading, plan: Plan, report_paths: Sequence[Path], shape: str | None = None,
    verdict: MeasuredStep | None = None,
) -> None:
    """Log the measured figures as `ckpt/*` metrics, print them next to the prediction, warn loudly when
    `verdict` (the engine's) is over the budget, and add them to the JSON report (its ``"measured"`` entry,
    for the first shape measured) when one was written."""
    metrics = {
        "ckpt/measured_peak_bytes": reading.peak_bytes,
        "ckpt/measured_rss_peak_bytes": reading.rss_peak_bytes,
        "ckpt/measured_rss_anon_peak_bytes": reading.rss_anon_peak_bytes,
        "ckpt/measured_reserved_peak_bytes": reading.reserved_peak_bytes,
    }
    log_metrics(trainer, {k: float(v) for k, v in metrics.items() if v is not None})
    rank_zero_info(summary(reading, plan, shape, None if verdict is None or verdict.over else verdict))
    held = {} if verdict is None else {"over_budget": verdict.over, "reserve_bytes": verdict.reserve_bytes}
    if verdict is not None and verdict.over:
        rank_zero_warn(verdict.message())
    for path in report_paths:
        if Path(path).name == REPORT_JSON:
            _add_to_report(Path(path), {"predicted_peak_bytes": plan.predicted_peak_bytes, **reading.to_dict(), **held})


def _add_to_report(path: Path, measured: dict) -> None:
    """The measured peak into the report JSON, replaced whole; a report that cannot be read or
    written is one warning, and training goes on (the report is optional output)."""
    try:
        data = json.loads(path.read_text())
        if "measured" in data:
            return
        data["measured"] = measured
        write_whole(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))
    except (OSError, ValueError) as err:
        rank_zero_warn(
            f"lightning-ckpt: the measured peak could not be added to the report {path} ({type(err).__name__}: {err}); "
            "training goes on, and the measured peak is in the logged ckpt/measured_* metrics."
        )
