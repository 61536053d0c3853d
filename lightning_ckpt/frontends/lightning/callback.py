"""`ActivationCheckpointing`: the Lightning callback that profiles, plans and applies.

At every training batch start the engine (`lightning_ckpt.engine`) makes the plan for the batch's
shape the applied one (profiled and planned on rank 0 the first time a shape comes); at fit start
for ``target_batch_size="max"``. The callback adds what is Lightning's: the loader's batch size,
logs and the report, the measured peak and the plan in checkpoints. Each fit binds an engine of its
own; at teardown (or when the fit fails) it lets go of the model and the trainer, so one callback
serves any number of fits, of the same model or new ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_ckpt.engine import POLICIES, BatchShape, CheckpointEngine, EngineSettings, ShapeDecision, arguments
from lightning_ckpt.engine.chain_levels import engine_for_chain, skips_coarser
from lightning_ckpt.frontends.lightning import loader_batch_size as loader
from lightning_ckpt.frontends.lightning import measured_peak, resume
from lightning_ckpt.frontends.lightning.lightning_driver import LightningDriver
from lightning_ckpt.frontends.lightning.loggers import finish_reports, log_metrics, write_plan_report
from lightning_ckpt.profiling.memory.tracker import StepBytesTracker
from lightning_ckpt.report.summary import plan_metrics, plan_summary
from lightning_ckpt.units import parse_bytes


class PlanOnly(Exception):
    """Raised after planning when the callback runs with `plan_only=True` (the preview command)."""


class ActivationCheckpointing(Callback):
    """Checkpoint the blocks of a model so training at `target_batch_size` fits `memory_budget`.

    Args (README.md's table has each in full):
        target_batch_size: per-device batch to train at (the loader is set to it), or ``"max"``: the largest that fits.
        memory_budget: per-device peak for the whole step, bytes or e.g. ``"6GiB"`` (CUDA default: 90% of free).
        blocks: a dotted path to the container of blocks, a list of paths / glob patterns naming a chain in
            call order, or None: the chain, across containers, holding most of the bytes the step saves.
        policy: ``optimal`` (least recompute that fits), ``greedy``, ``sqrt``, ``every_k``, ``full``, ``none``.
        every_k: blocks per segment for ``policy="every_k"``; None picks the smallest k that fits.
        cost_metric: recompute in ``time`` (counted work at rates measured on this device), ``flops`` or ``ms``.
        granularity: ``block``, or ``op``: a block checkpointed alone may keep some op outputs (``optimal``).
        max_levels: how deep ``optimal`` may nest segments (1: single-level; 2: inner segments in a recompute).
        batch_arg_name: attribute holding the loader's batch size (module, hparams or datamodule).
        probe_batch_sizes: the two small slices of the first training batch profiled (a line in the batch).
        check_batch_size: a third size that checks the line (None, or larger than the first batch: skipped).
        guard_batchnorm: keep BatchNorm statistics from being updated by a recompute.
        verbose: print the plan table on rank 0.
        batch_multiple: with ``target_batch_size="max"``, round the batch down to a multiple of this.
        strict_resume: when a checkpoint's plan no longer matches the model or does not hold, raise instead of re-planning.
        measure_peak: measure the first steady step of each batch shape, and again after each re-plan of it (CPU:
            tracked tensors, cheaply; CUDA: max allocated) beside the prediction; a step over the budget is a
            warning with both numbers, and its shape is planned again with the excess held in reserve. False:
            never measured.
        report: write the plan and profile as JSON and the trade-off plot as PNG to the log directory.
        plan_only: stop after planning (raises `PlanOnly`), used by ``python -m lightning_ckpt plan``.
        tune_allocator: make the memory the OS or GPU sees follow the tensors; None: on CUDA only
            (``expandable_segments``); True: glibc malloc thresholds on CPU too (slower steps); False: never.
        keep_hf_checkpointing: leave a model's own (HF) gradient checkpointing in charge (no plan applied).
        allow_python_state: let blocks whose forward writes Python state be checkpointed (True, or their names).
        host_memory_budget: per-rank host memory for what the strategy offloads (ZeRO-Offload, FSDP2's
            `CPUOffloadPolicy`), bytes or e.g. ``"32GiB"``; checked before the first plan. None: 80% of the
            host memory available at fit start, divided by the ranks on this machine.
    """

    POLICIES = POLICIES

    def __init__(
        self,
        target_batch_size: int | Literal["max"],
        memory_budget: int | str | None = None,
        blocks: str | list[str] | None = None,
        policy: str = "optimal",
        every_k: int | None = None,
        cost_metric: Literal["flops", "ms", "time"] = "time",
        granularity: Literal["block", "op"] = "block",
        max_levels: int = 2,
        batch_arg_name: str = "batch_size",
        probe_batch_sizes: tuple[int, int] = (1, 2),
        check_batch_size: int | None = 4,
        guard_batchnorm: bool = True,
        verbose: bool = True,
        batch_multiple: int = 1,
        strict_resume: bool = False,
        measure_peak: bool = True,
        report: bool = True,
        plan_only: bool = False,
        tune_allocator: bool | None = None,
        keep_hf_checkpointing: bool = False,
        allow_python_state: bool | list[str] = False,
        host_memory_budget: int | str | None = None,
    ) -> None:
        super().__init__()
        arguments.check_target(target_batch_size, batch_multiple)
        self.memory_budget = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        self.host_memory_budget = (
            None if host_memory_budget is None else parse_bytes(host_memory_budget, "host_memory_budget")
        )
        arguments.check_policy(policy, every_k, cost_metric, granularity, max_levels)
        self.blocks = arguments.check_blocks(blocks)
        arguments.check_name(batch_arg_name, "batch_arg_name", "the attribute that holds the loader's batch size.")
        arguments.check_flags(
            ("tune_allocator",), guard_batchnorm=guard_batchnorm, verbose=verbose,
            strict_resume=strict_resume, measure_peak=measure_peak, report=report, plan_only=plan_only,
            tune_allocator=tune_allocator, keep_hf_checkpointing=keep_hf_checkpointing,
        )
        self._settings = dict(
            policy=policy, every_k=every_k, cost_metric=cost_metric, granularity=granularity, max_levels=max_levels,
            probe_batch_sizes=arguments.check_probes(probe_batch_sizes, check_batch_size),
            check_batch_size=check_batch_size, guard_batchnorm=guard_batchnorm, batch_multiple=batch_multiple,
            keep_hf_checkpointing=keep_hf_checkpointing,
            allow_python_state=arguments.check_allow_python_state(allow_python_state),
        )
        self.target_batch_size, self.policy, self.granularity, self.max_levels = target_batch_size, policy, granularity, max_levels
        self.cost_metric, self.batch_arg_name, self.verbose, self.strict_resume = cost_metric, batch_arg_name, verbose, strict_resume
        self.measure_peak, self.report, self.plan_only, self.tune_allocator = measure_peak, report, plan_only, tune_allocator
        self.batch_size: int | None = None if target_batch_size == "max" else int(target_batch_size)
        # one per fit, made at its first bind; after the fit it holds nothing of the model or the trainer, and
        # shows the fit's plan until the next fit binds a new one (`_bind`)
        self.engine: CheckpointEngine | None = None
        self.measured_peak_bytes: int | None = None
        self.measured_peaks: dict[BatchShape, int | None] = {}  # measured step peak per shape (measure_peak)
        self.report_paths: list[Path] = []
        self._fit_memory = None
        self._budget_bytes: int | None = None
        self._host_budget_bytes: int | None = None
        self._loaded: dict[str, Any] | None = None
        self._loaded_from: str | None = None  # the checkpoint `_loaded` came from (`Trainer.fit(ckpt_path=...)`)
        self._measuring = contextlib.ExitStack()  # holds the first steady step's `step_peak`
        self._peak: measured_peak.PeakReading | None = None
        self._planned_in_fit = self._bound = False  # planned / the engine on this fit's blocks
        self._told_slices = False

    plan = property(lambda self: None if self.engine is None else self.engine.plan, doc="The applied plan.")
    profile = property(lambda self: None if self.engine is None else self.engine.profile, doc="The first profile.")
    cost = property(lambda self: None if self.engine is None else self.engine.cost, doc="The applied plan's step cost.")
    block_names = property(lambda self: [] if self.engine is None else self.engine.block_names)
    plans = property(lambda self: {} if self.engine is None else self.engine.plans, doc="The plan of every shape.")
    profile_runs = property(lambda self: 0 if self.engine is None else self.engine.profile_runs, doc="Shapes profiled.")
    profiled_steps = property(lambda self: 0 if self.engine is None else self.engine.profiled_steps, doc="Batches profiled.")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._budget_bytes = arguments.resolve_budget(self.memory_budget, trainer.strategy.root_device)
            self._host_budget_bytes = arguments.resolve_host_budget(self.host_memory_budget, trainer.num_devices)
            self._fit_memory = measured_peak.fit_memory(trainer, self.tune_allocator)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after `configure_model` (and the strategy's wrapping): a model built there exists only now
        self._planned_in_fit, self._bound, self.measured_peaks = False, False, {}  # each fit plans as the first
        self.measured_peak_bytes, self.report_paths, self._told_slices = None, [], False
        if self.target_batch_size == "max":  # profile one batch of the current loader, plan the largest
            batch = loader.first_train_batch(trainer)
            self._bind(trainer, pl_module, batch)
            self.batch_size = self.engine.plan_max(batch).batch_size
        elif self.blocks is not None:  # (blocks=None: found from the first training batch, when it comes)
            self._bind(trainer, pl_module, None)
        loader.set_loader_batch_size(trainer, pl_module, self.batch_arg_name, self.batch_size)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        first = not self._planned_in_fit
        if first:
            loader.check_first_batch(batch, self.batch_size, self.batch_arg_name, loader.train_dataset_len(trainer))
        if not self._bound:
            self._bind(trainer, pl_module, batch)
        decision = self.engine.step(batch, batch_idx)
        if decision is not None:
            self._planned_in_fit = True
            self._announce(trainer, decision, first)
        self._start_measuring(trainer, pl_module, batch, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._bound and self.engine is not None:  # are the gradients alive through this backward?
            self.engine.driver.observe_backward(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._peak is None:
            return
        self._measuring.close()
        reading, self._peak = self._peak, None
        shape, plan = self.engine.shape, self.plan
        verdict = self.engine.measured(reading.peak_bytes, reading.what)  # over the budget: re-planned now
        if verdict.replanned is None:  # (else its next step is measured, under the new plan)
            self.measured_peaks[shape] = reading.peak_bytes
        else:
            log_metrics(trainer, plan_metrics(self.plan))
        if self.measured_peak_bytes is None:
            self.measured_peak_bytes = reading.peak_bytes
        measured_peak.report(trainer, reading, plan, self.report_paths, shape.describe(), verdict)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._measuring.close()  # a step cut short is not measured
        self._peak = None
        finish_reports()  # the report's PNG, drawn while training went on
        if self._fit_memory is not None and stage == "fit":
            self._fit_memory.restore()  # the allocator as it was before this fit
            self._fit_memory = None
        if stage == "fit":  # a checkpoint's plan serves the fit that loaded it only
            self._loaded = self._loaded_from = None
        if self.engine is not None:  # the plan off, the model's settings back; nothing of it or its trainer kept
            self.engine.release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        explained = exception if self.engine is None else self.engine.explain(exception, pl_module)
        self.teardown(trainer, pl_module, "fit")  # Lightning skips the `teardown` hooks when fit raises
        if explained is not exception:  # a recompute that did not repeat its forward: its likely cause and fix
            raise explained from exception

    @override
    def state_dict(self) -> dict[str, Any]:
        signature = [] if self.engine is None else self.engine.signature
        shapes = (None, None) if self.engine is None else (self.engine.shape, self.engine.profile_shape)
        return resume.callback_state(
            self.plan, self.profile, self.cost, signature, self._budget_bytes, self.policy, *shapes
        )

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._loaded_from = None if trainer.ckpt_path is None else str(trainer.ckpt_path)  # named in what resume says

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict if not isinstance(state_dict, dict) else dict(state_dict)

    def _bind(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """A new engine on this fit's blocks (`blocks=None`: the chain holding most of `batch`'s step bytes);
        it plans as the first fit did, whatever the callback served before."""
        driver = LightningDriver(trainer)
        found = driver.chain(pl_module, self.blocks, batch, self._budget_bytes)
        settings = EngineSettings(self._budget_bytes, **self._settings, host_budget_bytes=self._host_budget_bytes)
        if isinstance(found, tuple):  # a new engine: nothing of an earlier fit's model, trainer or shapes
            names, blocks = found
            self.engine = CheckpointEngine(settings, driver)
        else:  # blocks=None: the level of the module tree whose chain plans least recompute (or the largest batch)
            self.engine, chosen = self._engine_for_chain(found, settings, driver, pl_module, batch)
            names, blocks = list(chosen.names), list(chosen.modules)
        self.engine.bind(blocks, names, settings, model=pl_module)  # HF caches off for the fit (`model_compat`)
        self.engine.resume_with, self._bound = self._resumed_plan, True

    def _engine_for_chain(self, choice, settings, driver, pl_module, batch):
        """(engine, chain) of the chain `choice` offers that plans best (`engine.chain_levels`); resumed from a
        checkpoint, the chain it was planned over when it is among them."""
        maximize = self.target_batch_size == "max"
        signature = self._loaded.get("signature") if isinstance(self._loaded, dict) else None
        stored = [e[0] for e in signature if isinstance(e, (list, tuple)) and e] if isinstance(signature, list) else []
        match = [c for c in choice.candidates if list(c.names) == stored]
        if match:
            choice = dataclasses.replace(match[0], alternatives=())

        told: set[str] = set()  # what was said of the model, once for all the candidates' engines

        def make(cand):
            engine = CheckpointEngine(settings, driver, told)
            engine.bind(list(cand.modules), list(cand.names), settings, model=pl_module)
            return engine

        plan = (lambda e: e.plan_max(batch)) if maximize else (lambda e: e.preview(batch))
        return engine_for_chain(choice, make, plan, self.batch_size if not maximize else 1, maximize, rank_zero_info,
                                skips_coarser(settings.policy, settings.granularity))

    def _resumed_plan(self, shape: BatchShape, static, grads_accumulate: bool) -> resume.ResumedPlan | None:
        """What the checkpoint gives the batch of `shape` (consulted once, before the first plan)."""
        loaded, where, self._loaded, self._loaded_from = self._loaded, self._loaded_from, None, None
        return resume.resumed_plan(
            loaded, self.engine.signature, self.target_batch_size, self._budget_bytes, self.policy,
            strict=self.strict_resume, shape=shape, static=static, granularity=self.granularity,
            max_levels=self.max_levels, grads_accumulate=grads_accumulate, checkpoint=where,
        )

    def _announce(self, trainer: pl.Trainer, decision: ShapeDecision, first: bool) -> None:
        """The plan table, metrics and report for the fit's first plan; one line for each new shape's."""
        if first:
            if self.verbose or not self.plan.segments:
                rank_zero_info(plan_summary(self.plan))
            log_metrics(trainer, plan_metrics(self.plan))
            if self.report:
                self.report_paths = write_plan_report(trainer, self.plan, self.profile, self.cost, self.cost_metric)
            if self.plan_only:
                raise PlanOnly(str(self.plan))
        elif decision.new:
            rank_zero_info(self.engine.describe(decision))
            log_metrics(trainer, plan_metrics(self.plan))
        if self.engine.slice_error and not self._told_slices:
            self._told_slices = True
            rank_zero_info(
                f"lightning-ckpt: new batch lengths are profiled on real batches only from now on: {self.engine.slice_error}."
            )

    def _start_measuring(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Measure the first steady step under each plan (optimizer state exists, and with gradient
        accumulation gradients from an earlier micro-batch are alive, as the plan assumes): a shape's first
        plan, and again after each re-plan of it (accumulation changed, a reserve, a resumed plan)."""
        if self._peak is not None or self.engine.plan_measured:
            return
        accumulating = trainer.accumulate_grad_batches == 1 or batch_idx % trainer.accumulate_grad_batches != 0
        if accumulating and measured_peak.should_measure(trainer, self.measure_peak):
            reading = measured_peak.step_peak(trainer, pl_module, batch, self._fit_memory, StepBytesTracker)
            self._peak = self._measuring.enter_context(reading)
