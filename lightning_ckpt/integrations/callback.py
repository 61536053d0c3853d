"""`ActivationCheckpointing`: the Lightning callback that profiles, plans and applies.

On the first training batch (at fit start for ``target_batch_size="max"``) it profiles the step on
slices of the batch, plans on rank 0 within `memory_budget`, applies the plan on every rank and logs it.
The Lightning glue is in the sibling modules of `lightning_ckpt.integrations`, the work in the core.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ckpt.apply import AppliedPlan
from lightning_ckpt.integrations import arguments, compiled, measured_peak, rank_shapes, resume, target_plan
from lightning_ckpt.integrations import loader_batch_size as loader
from lightning_ckpt.integrations.loggers import log_metrics, write_plan_report
from lightning_ckpt.integrations.profile_step import profile_first_batch
from lightning_ckpt.integrations.rank_zero import plan_on_rank_zero
from lightning_ckpt.integrations.strategy_hooks import strategy_static_memory
from lightning_ckpt.planning.costs import StepCost
from lightning_ckpt.planning.linear_fit import Profile
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import POLICIES
from lightning_ckpt.profiling.blocks import resolve_blocks
from lightning_ckpt.profiling.static_memory import StaticMemory
from lightning_ckpt.planning.policies import InfeasibleBudgetError
from lightning_ckpt.profiling.shapes import BatchShape, shape_of
from lightning_ckpt.report import plan_metrics, plan_summary
from lightning_ckpt.shape_plans import CostSource, ShapeDecision, ShapePlans, largest_shape, same_regions
from lightning_ckpt.shape_plans import describe as describe_decision
from lightning_ckpt.units import parse_bytes


class PlanOnly(Exception):
    """Raised after planning when the callback runs with `plan_only=True` (the preview command)."""


class ActivationCheckpointing(Callback):
    """Checkpoint the blocks of a model so training at `target_batch_size` fits `memory_budget`.

    Args:
        target_batch_size: per-device batch size to train at (the train loader is set to it),
            or ``"max"``: the largest batch whose best plan fits, found from the profile.
        memory_budget: per-device peak allowed for the whole step (parameters, gradients,
            optimizer state, activations), bytes or a string like ``"6GiB"``. Default on
            CUDA: 90% of the device's memory free at fit start; on CPU it must be given.
        blocks: dotted path to the ordered container of blocks (``"encoder.layers"``); a list of
            dotted paths / glob patterns naming a chain of modules in call order
            (``["stem", "layer1.*", "layer2.*"]``); or None to pick the largest container of
            same-class modules.
        policy: ``optimal`` (least recompute that fits), ``greedy``, ``sqrt``, ``every_k``,
            ``full`` or ``none``.
        every_k: blocks per segment for ``policy="every_k"``; None picks the smallest k that fits.
        cost_metric: what recompute is measured in when choosing: ``time`` (the default;
            estimated ms: the counted FLOPs, bytes written by ops without FLOPs and random
            bytes, each at a rate measured once on this device; see `lightning_ckpt.profiling.rates`),
            ``flops`` (FLOPs counted by torch: independent of the machine, but layer norm,
            softmax, GELU and dropout count 0, so blocks made of them look free) or ``ms``
            (each block's forward timed once while profiling: noisy).
        granularity: ``block`` checkpoints whole blocks; ``op`` (with ``policy="optimal"``) also lets a
            block checkpointed alone keep some op outputs (matmuls, dropout masks) and recompute the rest.
        max_levels: how deep ``policy="optimal"`` may nest segments: 1 plans single-level segments; 2 (the
            default) lets a segment's recompute checkpoint inner segments of its own, used only when that
            fits a budget nothing single-level fits or recomputes less (docs/usage.md, multi-level plans).
        batch_arg_name: attribute holding the loader's batch size (module, hparams or datamodule).
        probe_batch_sizes: the two small batch sizes profiled, slices of the first training batch
            (so at most its size); bytes are fitted as a line in them.
        check_batch_size: a third size that checks the line (None, or larger than the first batch: skipped).
        guard_batchnorm: keep BatchNorm statistics from being updated by a recompute.
        verbose: print the plan table on rank 0.
        batch_multiple: with ``target_batch_size="max"``, round the batch down to a multiple of this.
        strict_resume: when a checkpoint's plan no longer matches the model, raise instead of re-planning.
        measure_peak: log the measured peak of the first planned step next to the prediction
            (None: on CUDA only; on CPU tracking every tensor costs time, so ask for it).
        report: write the plan and profile as JSON and the trade-off plot as PNG to the logger's
            directory (without a logger: the Trainer's ``default_root_dir``).
        plan_only: stop after planning (raises `PlanOnly`), used by ``python -m lightning_ckpt plan``.
        tune_allocator: for the fit, make the memory the OS or GPU sees follow the tensors (glibc
            malloc thresholds on CPU, ``expandable_segments`` on CUDA; see docs/memory.md).
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
        measure_peak: bool | None = None,
        report: bool = True,
        plan_only: bool = False,
        tune_allocator: bool = True,
    ) -> None:
        super().__init__()
        arguments.check_target(target_batch_size, batch_multiple)
        self.memory_budget = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        arguments.check_policy(policy, every_k, cost_metric, granularity, max_levels)
        self.max_levels = max_levels
        self.blocks = arguments.check_blocks(blocks)
        self.probe_batch_sizes = arguments.check_probes(probe_batch_sizes, check_batch_size)
        self.target_batch_size, self.batch_multiple = target_batch_size, batch_multiple
        self.policy, self.every_k, self.cost_metric, self.granularity = policy, every_k, cost_metric, granularity
        self.batch_arg_name, self.check_batch_size = batch_arg_name, check_batch_size
        self.guard_batchnorm, self.verbose, self.strict_resume = guard_batchnorm, verbose, strict_resume
        self.measure_peak, self.report, self.plan_only, self.tune_allocator = measure_peak, report, plan_only, tune_allocator
        self._fit_memory = None

        self.plan: Plan | None = None
        self.profile: Profile | None = None
        self.cost: StepCost | None = None
        self.block_names: list[str] = []
        self.batch_size: int | None = None if target_batch_size == "max" else int(target_batch_size)
        self.profiled_steps = 0  # how many times this callback profiled (0 after a resume)
        self.measured_peak_bytes: int | None = None
        self.report_paths: list[Path] = []
        self._blocks: list[torch.nn.Module] = []
        self._applied: AppliedPlan | None = None
        self._budget_bytes: int | None = None
        self._loaded: dict[str, Any] | None = None
        self._static: StaticMemory | None = None
        self._measuring = contextlib.ExitStack()  # holds the first steady step's `step_peak`
        self._peak: measured_peak.PeakReading | None = None
        self._shapes: ShapePlans | None = None  # profiles and plans per batch shape, kept across fits of one model
        self._signature: list | None = None
        self._shape: BatchShape | None = None  # the shape the applied plan was made for
        self._costs: dict[BatchShape, StepCost] = {}
        self._rates = None  # MachineRates measured with the first profile, reused for later shapes
        self._resumed: Plan | None = None
        self._find_max = False
        self._told_slices = False
        self._fit_batches = 0
        self._batch_idx = 0
        self._trainer: pl.Trainer | None = None
        self.measured_peaks: dict[BatchShape, int | None] = {}  # measured step peak per shape (measure_peak)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._budget_bytes = arguments.resolve_budget(self.memory_budget, trainer.strategy.root_device)
            self._fit_memory = measured_peak.fit_memory(trainer, self.tune_allocator)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after `configure_model` (and the strategy's wrapping): a model built there exists only now
        _, self.block_names, self._blocks = resolve_blocks(pl_module, self.blocks)
        signature = resume.block_signature(self.block_names, self._blocks)
        if self._shapes is None or signature != self._signature:  # another model: what was profiled is void
            self.profile, self._costs = None, {}
            self._shapes = ShapePlans(self._profile_shape, self._plan_shape)
        self._trainer = trainer  # what profiling and planning run with in this fit
        self._shapes.forget_plans()  # the budget, the optimizer or the settings may differ in this fit
        self._signature, self._static, self._shape, self._fit_batches = signature, None, None, 0
        self.measured_peaks = {}
        if self.target_batch_size == "max":  # profile one batch of the current loader, plan the largest
            batch = loader.first_train_batch(trainer)
            self._find_max = True
            try:
                self.plan = self._plan_everywhere(trainer, batch, 0).plan
            finally:
                self._find_max = False
            self.batch_size = self.plan.batch_size
            self._shapes.forget_plans()  # the loader's batches come at the chosen size: planned when they arrive
        loader.set_loader_batch_size(trainer, pl_module, self.batch_arg_name, self.batch_size)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        shapes = rank_shapes.gather(trainer, shape_of(batch))  # every rank's, so that all decide alike
        shape = shapes[0] if len(set(shapes)) == 1 else largest_shape(shapes)
        if self._applied is not None and shape == self._shape:  # the shape of the step before: nothing to do
            self._start_measuring(trainer, pl_module, batch, batch_idx)
            return
        first = self._fit_batches == 0
        if first:
            loader.check_first_batch(batch, self.batch_size, self.batch_arg_name, loader.train_dataset_len(trainer))
        self._fit_batches += 1
        decision = self._plan_everywhere(trainer, batch, batch_idx, shapes)
        self._switch_to(pl_module, decision, shape)
        if first:
            if self.verbose or not self.plan.segments:
                rank_zero_info(plan_summary(self.plan))
            log_metrics(trainer, plan_metrics(self.plan))
            if self.report:
                self.report_paths = write_plan_report(trainer, self.plan, self.profile, self.cost, self.cost_metric)
            if self.plan_only:
                raise PlanOnly(str(self.plan))
        elif decision.new:
            rank_zero_info(describe_decision(decision, self._shapes))
            log_metrics(trainer, plan_metrics(self.plan))
        if self._shapes.slice_error and not self._told_slices:
            self._told_slices = True
            rank_zero_info(
                f"lightning-ckpt: new batch lengths are profiled on real batches only from now on: {self._shapes.slice_error}."
            )
        self._start_measuring(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._peak is None:
            return
        self._measuring.close()
        reading, self._peak = self._peak, None
        self.measured_peaks[self._shape] = reading.peak_bytes
        if self.measured_peak_bytes is None:
            self.measured_peak_bytes = reading.peak_bytes
        measured_peak.report(trainer, reading, self.plan, self.report_paths, self._shape.describe())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._measuring.close()  # a step cut short is not measured
        self._peak = None
        if self._fit_memory is not None and stage == "fit":
            self._fit_memory.restore()  # the allocator as it was before this fit
            self._fit_memory = None
        if self._applied is not None:
            self._applied.remove()
            self._applied = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning skips the `teardown` hooks when fit raises

    @override
    def state_dict(self) -> dict[str, Any]:
        signature = resume.block_signature(self.block_names, self._blocks)
        return resume.callback_state(self.plan, self.profile, self.cost, signature, self._budget_bytes, self.policy)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)

    @property
    def plans(self) -> dict[BatchShape, Plan]:
        """The plan made for every batch shape of this fit (the applied one is `plan`)."""
        return {} if self._shapes is None else {d.shape: d.plan for d in self._shapes.plans.values()}

    @property
    def profile_runs(self) -> int:
        """How many shapes this callback profiled (each on a few small slices of a batch)."""
        return 0 if self._shapes is None else self._shapes.profile_runs

    def _start_measuring(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Measure the first steady step of each shape (optimizer state exists, and with gradient
        accumulation gradients from an earlier micro-batch are alive, as the plan assumes), once."""
        if self._peak is not None or self._shape in self.measured_peaks:
            return
        accumulating = trainer.accumulate_grad_batches == 1 or batch_idx % trainer.accumulate_grad_batches != 0
        if accumulating and measured_peak.should_measure(trainer, self.measure_peak):
            reading = measured_peak.step_peak(trainer, pl_module, batch, self._fit_memory)
            self._peak = self._measuring.enter_context(reading)

    def _switch_to(self, pl_module: pl.LightningModule, decision: ShapeDecision, shape: BatchShape) -> None:
        """Apply `decision`'s plan in place of the one applied (hooks only; kept when they are the same)."""
        plan = decision.plan
        if self._applied is None or not same_regions(plan, self.plan):
            if self._applied is not None:
                self._applied.remove()
                self._applied = None
            self._applied = compiled.apply_plan(pl_module, self._blocks, self.block_names, plan, self.guard_batchnorm)
        self.plan, self._shape = plan, shape
        self.cost = self._costs.get(shape, self.cost)

    def _plan_everywhere(
        self, trainer: pl.Trainer, batch: Any, batch_idx: int, shapes: list[BatchShape] | None = None
    ) -> ShapeDecision:
        """The plan for `batch`'s shape: cached, resumed from a checkpoint, or profiled and planned on
        rank 0 (every rank profiles); rank 0's on every rank."""
        shape = shape_of(batch)
        shapes = [shape] if shapes is None else shapes
        if len(set(shapes)) > 1:  # the ranks' batches differ: every rank runs the plan of the largest
            return self._plan_largest(trainer, batch, shape, shapes, batch_idx)
        hit = self._shapes.cached(shape)
        if hit is not None:
            return dataclasses.replace(hit, new=False)
        self._batch_idx = batch_idx
        if self._applied is not None:  # profiling runs the model as it is without a plan
            self._applied.remove()
            self._applied = None

        def resumed_or_planned() -> Plan | None:
            loaded, self._loaded = self._loaded, None
            resumed = resume.resumed_plan(
                loaded, self._signature, self.target_batch_size, self._budget_bytes, self.policy,
                strict=self.strict_resume, granularity=self.granularity, max_levels=self.max_levels,
            )
            if resumed is not None and resumed.profile is not None:
                self._shapes.add_profile(shape, resumed.profile)
                self.profile = resumed.profile
                self._costs[shape] = resumed.cost
                self._resumed = resumed.plan
            return self._shapes.plan_for(batch, shape).plan

        broadcast = functools.partial(trainer.strategy.broadcast, src=0)
        plan = plan_on_rank_zero(resumed_or_planned, broadcast, trainer.global_rank)
        return self._shapes.settle(shape, plan)

    def _plan_largest(
        self, trainer: pl.Trainer, batch: Any, shape: BatchShape, shapes: list[BatchShape], batch_idx: int
    ) -> ShapeDecision:
        """With the ranks' batches of different shapes: the plan of their largest shape on every rank.
        When some rank's shape was never profiled, every rank profiles its own batch (collectively, as
        sharded parameters are gathered) and all profiles are shared before rank 0 plans."""
        largest = largest_shape(shapes)
        hit = self._shapes.cached(largest)
        if hit is not None:
            return dataclasses.replace(hit, new=False)
        self._batch_idx = batch_idx
        if self._applied is not None:
            self._applied.remove()
            self._applied = None
        if any(s not in self._shapes.profiled_shapes for s in shapes):
            profile = None
            try:
                profile = self._shapes.profile_own(batch, shape)
            except Exception as err:  # noqa: BLE001 - every rank must reach the exchange below
                rank_zero_warn(f"lightning-ckpt: rank {trainer.global_rank} failed to profile ({err}).")
            for other, data in rank_shapes.exchange(trainer, shape, profile):
                self._shapes.add_profile(other, Profile.from_dict(data))
        broadcast = functools.partial(trainer.strategy.broadcast, src=0)
        plan = plan_on_rank_zero(lambda: self._shapes.plan_for(None, largest).plan, broadcast, trainer.global_rank)
        return self._shapes.settle(largest, plan)

    def _profile_shape(self, batch: Any, own: bool) -> Profile:
        """Profile the blocks on slices of `batch` (`own`: the batch of the step about to run; else a
        prefix of it at a shorter length)."""
        trainer = self._trainer
        pl_module = trainer.lightning_module
        profile = profile_first_batch(
            trainer, pl_module, self._blocks, self.block_names, batch, self._batch_idx, self.probe_batch_sizes,
            self.check_batch_size, rates=self._rates,
            calibrate_keeps=own and self._rates is None and self.granularity == "op" and self.cost_metric == "time",
        )
        self.profiled_steps += own
        if self._rates is None:
            self._rates = profile.probes[0].rates
        if self.profile is None:
            self.profile = profile
        return profile

    def _plan_shape(self, cost_of: Callable[..., StepCost], shape: BatchShape) -> Plan | None:
        """Rank 0's plan at `shape` from `cost_of` (None on the other ranks, which take rank 0's)."""
        trainer = self._trainer
        if not trainer.is_global_zero:
            return None
        if self._resumed is not None:  # the checkpoint's plan, for the shape it was made at
            plan, self._resumed = self._resumed, None
            return plan
        if self._static is None:
            self._static = strategy_static_memory(trainer, trainer.lightning_module)
        request = target_plan.PlanRequest(
            self._budget_bytes, self.policy, self.every_k, self.cost_metric, self.granularity, self.max_levels
        )
        costs = CostSource(cost_of, grads_accumulate=trainer.accumulate_grad_batches > 1)
        if self._find_max:
            plan, cost = target_plan.plan_for_max(costs, self._static, request, self.batch_multiple)
            rank_zero_info(
                f"lightning-ckpt: target_batch_size='max' -> {plan.batch_size} (a multiple of {self.batch_multiple}) "
                f"at the shape of the first training batch ({shape.describe()}); batches of other shapes are planned "
                "when they arrive at that size, and one that cannot fit stops the run before its step."
            )
        else:
            try:
                plan, cost = target_plan.plan_for_target(costs, self._static, request, shape.batch_size)
            except InfeasibleBudgetError as err:
                raise InfeasibleBudgetError(f"the training batch of shape ({shape.describe()}): {err}") from None
        self._costs[shape] = cost
        self.cost = cost
        return plan
