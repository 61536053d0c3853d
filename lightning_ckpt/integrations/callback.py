"""`ActivationCheckpointing`: the Lightning callback that profiles, plans and applies.

At the start of fit it sets the loader to `target_batch_size` (as Lightning's
`BatchSizeFinder` does), then on the first training batch it profiles the step on
small slices of that batch, plans for the target within `memory_budget`, applies
the plan, prints the plan table on rank 0 and logs its prediction. All the work
is done by the pure core; this module only gathers inputs and applies results.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)

from lightning_ckpt.apply import AppliedPlan, apply_segments
from lightning_ckpt.planning.capacity import largest_batch
from lightning_ckpt.planning.costs import StepCost
from lightning_ckpt.planning.linear_fit import Profile
from lightning_ckpt.planning.plan import Plan, format_bytes
from lightning_ckpt.planning.policies import POLICIES, InfeasibleBudgetError, make_plan
from lightning_ckpt.planning.recompute_cost import COST_METRICS
from lightning_ckpt.profiling.batch import batch_size_of
from lightning_ckpt.profiling.blocks import resolve_blocks
from lightning_ckpt.profiling.profiler import profile_model
from lightning_ckpt.profiling.static_memory import StaticMemory, static_memory
from lightning_ckpt.profiling.tracker import LiveBytesTracker
from lightning_ckpt.units import parse_bytes

DEFAULT_CUDA_FRACTION = 0.9
REPORT_JSON = "lightning_ckpt_plan.json"
REPORT_PNG = "lightning_ckpt_tradeoff.png"


class PlanOnly(Exception):
    """Raised after planning when the callback runs with `plan_only=True` (the preview command)."""


def _positive_int(value: Any, name: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; {hint}")
    return value


class ActivationCheckpointing(Callback):
    """Checkpoint the blocks of a model so training at `target_batch_size` fits `memory_budget`.

    Args:
        target_batch_size: per-device batch size to train at (the train loader is set to it),
            or ``"max"``: the largest batch whose best plan fits, found from the profile.
        memory_budget: per-device peak allowed for the whole step (parameters, gradients,
            optimizer state, activations), bytes or a string like ``"6GiB"``. Default on
            CUDA: 90% of the device's memory; on CPU it must be given.
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
        batch_arg_name: attribute holding the loader's batch size (module, hparams or datamodule).
        probe_batch_sizes: the two small batch sizes profiled; bytes are fitted as a line in them.
        check_batch_size: a third size that checks the line (None to skip).
        guard_batchnorm: keep BatchNorm statistics from being updated by a recompute.
        verbose: print the plan table on rank 0.
        batch_multiple: with ``target_batch_size="max"``, round the batch down to a multiple of this.
        strict_resume: when a checkpoint's plan no longer matches the model, raise instead of re-planning.
        measure_peak: log the measured peak of the first planned step next to the prediction
            (None: on CUDA only; on CPU tracking every tensor costs time, so ask for it).
        report: write the plan and profile as JSON and the trade-off plot as PNG to the log dir.
        plan_only: stop after planning (raises `PlanOnly`), used by ``python -m lightning_ckpt plan``.
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
    ) -> None:
        super().__init__()
        if target_batch_size != "max":
            _positive_int(
                target_batch_size, "target_batch_size", "it is the per-device batch size to train at, or 'max'."
            )
        self.target_batch_size = target_batch_size
        self.batch_multiple = _positive_int(batch_multiple, "batch_multiple", "the 'max' batch is rounded down to a multiple of it.")
        if batch_multiple != 1 and target_batch_size != "max":
            raise ValueError(
                f"batch_multiple={batch_multiple} only applies to target_batch_size='max', but target_batch_size="
                f"{target_batch_size!r}; drop batch_multiple or set target_batch_size='max'."
            )
        self.strict_resume = strict_resume
        self.measure_peak = measure_peak
        self.report = report
        self.plan_only = plan_only
        self.memory_budget = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is not a known policy; choose one of {', '.join(POLICIES)}.")
        self.policy = policy
        if isinstance(blocks, (list, tuple)):
            blocks = list(blocks)
            if not blocks or not all(isinstance(b, str) and b.strip() for b in blocks):
                raise ValueError(
                    f"blocks={blocks!r} must list non-empty dotted paths or glob patterns, e.g. ['stem', 'layer1.*']."
                )
        elif blocks is not None and (not isinstance(blocks, str) or not blocks.strip()):
            raise ValueError(f"blocks={blocks!r} must be a dotted path such as 'encoder.layers', or None to auto-detect.")
        self.blocks = blocks
        if every_k is not None:
            _positive_int(every_k, "every_k", "it is the number of blocks per checkpointed segment.")
            if policy != "every_k":
                raise ValueError(f"every_k={every_k} only applies to policy='every_k', but policy={policy!r}; drop every_k or set policy='every_k'.")
        self.every_k = every_k
        if cost_metric not in COST_METRICS:
            raise ValueError(
                f"cost_metric={cost_metric!r} is not known; choose 'flops' (counted FLOPs, deterministic), "
                "'ms' (forward timed once per block) or 'time' (estimated from FLOPs and bytes at measured rates)."
            )
        self.cost_metric = cost_metric
        self.batch_arg_name = batch_arg_name
        probes = tuple(probe_batch_sizes)
        if len(probes) != 2 or len(set(probes)) != 2:
            raise ValueError(f"probe_batch_sizes={probe_batch_sizes!r} must be two different positive integers, e.g. (1, 2).")
        for p in probes:
            _positive_int(p, "probe_batch_sizes", "probes are small slices of a real batch.")
        self.probe_batch_sizes = probes
        if check_batch_size is not None:
            _positive_int(check_batch_size, "check_batch_size", "or None to skip the check of the fitted line.")
        self.check_batch_size = check_batch_size
        self.guard_batchnorm = guard_batchnorm
        self.verbose = verbose

        self.plan: Plan | None = None
        self.profile: Profile | None = None
        self.cost: StepCost | None = None
        self.block_names: list[str] = []
        self._blocks: list[torch.nn.Module] = []
        self._applied: AppliedPlan | None = None
        self._budget_bytes: int | None = None
        self._loaded: dict | None = None
        self._static: StaticMemory | None = None
        self._tracker: LiveBytesTracker | None = None
        self.batch_size: int | None = None if target_batch_size == "max" else int(target_batch_size)
        self.profiled_steps = 0  # how many times this callback profiled (0 after a resume)
        self.measured_peak_bytes: int | None = None

    # ------------------------------------------------------------------ environment
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _, self.block_names, self._blocks = resolve_blocks(pl_module, self.blocks)
        self._budget_bytes = self._resolve_budget(trainer)

    def _resolve_budget(self, trainer: pl.Trainer) -> int:
        if self.memory_budget is not None:
            return self.memory_budget
        device = trainer.strategy.root_device
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            return int(DEFAULT_CUDA_FRACTION * total)
        raise ValueError(
            f"memory_budget was not given and the training device is {device.type!r}: only on CUDA can "
            "lightning-ckpt read the device's memory size. Set memory_budget (bytes or e.g. '8GiB') to the "
            "per-device peak you allow for the whole training step."
        )

    # ------------------------------------------------------------------ batch size
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.target_batch_size == "max":
            self._plan_for_max(trainer, pl_module)
        self._set_loader_batch_size(trainer, pl_module)

    def _set_loader_batch_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            return  # checked against the first batch instead
        current = lightning_getattr(pl_module, self.batch_arg_name)
        if current == self.batch_size:
            return
        lightning_setattr(pl_module, self.batch_arg_name, self.batch_size)
        rank_zero_info(f"lightning-ckpt: {self.batch_arg_name} {current} -> {self.batch_size}")
        _reload_dataloaders(trainer)

    def _plan_for_max(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Profile one batch of the current loader, then pick the largest batch that fits."""
        loaded = self._plan_from_checkpoint()
        if loaded is not None:
            self.plan, self.batch_size = loaded, loaded.batch_size
            return
        loop = trainer.fit_loop
        loop.setup_data()
        batch = next(iter(trainer.train_dataloader))
        batch = trainer.strategy.batch_to_device(trainer.precision_plugin.convert_input(batch))
        outcome = self._plan_safely(lambda: self._profile_and_plan(trainer, pl_module, batch, 0, find_max=True))
        self._adopt(trainer, outcome)
        self.batch_size = self.plan.batch_size

    # ------------------------------------------------------------------ plan and apply
    # ------------------------------------------------------------------ plan and apply
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._applied is not None:
            self._start_measuring(trainer, pl_module)
            return
        n = batch_size_of(batch)
        if self.batch_size is not None and n != self.batch_size:
            raise ValueError(
                f"the first training batch has {n} samples but the planned batch size is {self.batch_size}; "
                f"lightning-ckpt sets the loader's batch size through the attribute {self.batch_arg_name!r} on the "
                "LightningModule, its hparams or the datamodule, and none was found or the loader ignores it. "
                f"Expose {self.batch_arg_name!r} (or set batch_arg_name) or build the loader with the target batch size."
            )
        if self.plan is None:
            plan = self._plan_from_checkpoint()
            if plan is None:
                outcome = self._plan_safely(lambda: self._profile_and_plan(trainer, pl_module, batch, batch_idx))
            else:
                outcome = {"plan": plan.to_dict(), "error": None}
            self._adopt(trainer, outcome)
        plan = self.plan
        assert plan is not None
        self._applied = apply_segments(self._blocks, plan.segments, guard_batchnorm=self.guard_batchnorm)
        if not plan.segments:
            rank_zero_info(
                f"lightning-ckpt: nothing to checkpoint: batch {plan.batch_size} is predicted to peak at "
                f"{format_bytes(plan.predicted_peak_bytes)} without checkpointing, within the budget of "
                f"{format_bytes(plan.budget_bytes or 0)}. Training runs unchanged."
            )
        elif self.verbose:
            rank_zero_info(str(plan))
        metrics = {
            "ckpt/predicted_peak_bytes": float(plan.predicted_peak_bytes),
            "ckpt/recompute_share": float(plan.recompute_share),
            "ckpt/checkpointed_blocks": float(len(plan.checkpointed)),
        }
        self._log(trainer, metrics)
        if self.report:
            log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # `log_dir` is a collective: all ranks
            if trainer.is_global_zero:
                self._write_report(log_dir)
        if self.plan_only:
            raise PlanOnly(str(plan))
        self._start_measuring(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        tracker, self._tracker = self._tracker, None
        device = trainer.strategy.root_device
        if tracker is not None:
            tracker.__exit__(None, None, None)
            self.measured_peak_bytes = tracker.peak_bytes
        elif self._measuring_cuda:
            self.measured_peak_bytes = int(torch.cuda.max_memory_allocated(device))
        else:
            return
        self._measuring_cuda = False
        self._log(trainer, {"ckpt/measured_peak_bytes": float(self.measured_peak_bytes)})
        rank_zero_info(
            f"lightning-ckpt: measured peak of the first planned step {format_bytes(self.measured_peak_bytes)}, "
            f"predicted {format_bytes(self.plan.predicted_peak_bytes)}"
        )

    _measuring_cuda = False

    def _start_measuring(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Measure the first steady step: optimizer state exists, as the plan assumes."""
        device = trainer.strategy.root_device
        wanted = self.measure_peak if self.measure_peak is not None else device.type == "cuda"
        steady = any(len(o.state) for o in trainer.optimizers) or not trainer.optimizers
        if not wanted or not steady or self.measured_peak_bytes is not None:
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._measuring_cuda = True
            return
        from lightning_ckpt.profiling.step_peak import state_tensors

        tracker = LiveBytesTracker()
        tracker.__enter__()
        tracker.adopt(state_tensors(pl_module, None) + [t for o in trainer.optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
        tracker.reset_peak()
        self._tracker = tracker

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _write_report(self, log_dir: Path) -> None:
        from lightning_ckpt.report import plot_tradeoff, write_json

        self.report_paths = [write_json(log_dir / REPORT_JSON, self.plan, self.profile, self.cost)]
        if self.cost is not None:
            self.report_paths.append(plot_tradeoff(log_dir / REPORT_PNG, self.cost, self.plan, metric=self.cost_metric))
        rank_zero_info(f"lightning-ckpt: plan report written to {', '.join(str(p) for p in self.report_paths)}")

    def _plan_safely(self, fn) -> dict:
        """Run planning; an error becomes data, so every rank can raise it after the broadcast.
        Only rank 0 plans (`fn` returns None elsewhere): its outcome is every rank's."""
        self._local_error = None
        try:
            plan = fn()
            return {"plan": None if plan is None else plan.to_dict(), "error": None}
        except Exception as err:  # any error must reach the broadcast, or the other ranks wait in it forever
            self._local_error = err
            return {
                "plan": None,
                "error": f"{type(err).__name__}: {err}",
                "infeasible": isinstance(err, InfeasibleBudgetError),
                "value_error": isinstance(err, ValueError),
            }

    def _adopt(self, trainer: pl.Trainer, outcome: dict) -> None:
        """Take rank 0's outcome on every rank: the same plan everywhere, or the same error."""
        outcome = trainer.strategy.broadcast(outcome, src=0)
        local, self._local_error = getattr(self, "_local_error", None), None
        if outcome["error"] is not None:
            if local is not None and trainer.is_global_zero:
                raise local
            kind = InfeasibleBudgetError if outcome.get("infeasible") else ValueError if outcome.get("value_error", True) else RuntimeError
            raise kind(outcome["error"].split(": ", 1)[1])
        if local is not None:
            warnings.warn(f"lightning-ckpt: rank {trainer.global_rank} failed to profile ({local}); it applies rank 0's plan.")
        self.plan = Plan.from_dict(outcome["plan"])

    def _plan_from_checkpoint(self) -> Plan | None:
        loaded, self._loaded = self._loaded, None
        if not loaded or loaded.get("plan") is None:
            return None
        plan = Plan.from_dict(loaded["plan"])
        problems = []
        if loaded.get("signature") != self._signature():
            problems.append(
                f"the blocks changed (checkpoint: {len(loaded.get('signature') or [])} blocks, "
                f"now: {len(self._blocks)} blocks or different parameter shapes)"
            )
        if self.target_batch_size != "max" and plan.batch_size != self.target_batch_size:
            problems.append(f"the plan is for batch {plan.batch_size}, target_batch_size is {self.target_batch_size}")
        if loaded.get("budget_bytes") != self._budget_bytes or loaded.get("policy") != self.policy:
            problems.append("memory_budget or policy changed")
        if problems:
            msg = f"lightning-ckpt: the checkpoint's plan does not match this run: {'; '.join(problems)}."
            if self.strict_resume:
                raise ValueError(msg + " strict_resume=True, so stopping; set strict_resume=False to plan again.")
            rank_zero_info(msg + " Planning again.")
            return None
        if loaded.get("profile") is not None:
            self.profile = Profile.from_dict(loaded["profile"])
        if loaded.get("cost") is not None:
            self.cost = StepCost.from_dict(loaded["cost"])
        return plan

    def _signature(self) -> list:
        return [[name, [list(p.shape) for p in blk.parameters()]] for name, blk in zip(self.block_names, self._blocks)]

    def _profile_and_plan(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, find_max: bool = False
    ) -> Plan | None:
        n = batch_size_of(batch)
        probes = tuple(min(p, n) for p in self.probe_batch_sizes)
        if len(set(probes)) != 2:
            probes = (1, 2) if n >= 2 else probes
        if n < 2:
            raise ValueError(f"profiling needs at least 2 samples in the first batch to fit a line; it has {n}.")
        check = self.check_batch_size if self.check_batch_size is not None and self.check_batch_size <= n else None

        def step_fn(b: Any) -> torch.Tensor:
            with _muted_logging(pl_module), trainer.precision_plugin.train_step_context():
                return pl_module.training_step(b, batch_idx)

        with _profiling_context(trainer):
            self.profile = profile_model(pl_module, self._blocks, step_fn, batch, probes, check, names=self.block_names)
        self.profiled_steps += 1
        err = self.profile.check_error()
        if err > 0.05:
            rank_zero_info(
                f"lightning-ckpt: bytes predicted from batches {probes} miss the measurement at batch {check} by "
                f"{100 * err:.1f}%; the model's memory is not linear in the batch size, so the plan may be off."
            )
        if not trainer.is_global_zero:
            return None  # every rank profiles (ZeRO-3 gathers parameters collectively); only rank 0 plans
        self._static = static = _static_memory(trainer, pl_module)
        if find_max:
            return self._max_plan(static)
        self.cost = self._cost_at(self.target_batch_size, static)
        return self._make_plan(self.cost, static)

    def _max_plan(self, static: StaticMemory) -> Plan:
        best, plan = largest_batch(
            lambda b: self._cost_at(b, static), self._budget_bytes, self.policy, self.batch_multiple,
            every_k=self.every_k, metric=self.cost_metric,
        )
        if plan is None:
            raise InfeasibleBudgetError(
                f"target_batch_size='max': not even batch size {self.batch_multiple} fits memory_budget="
                f"{format_bytes(self._budget_bytes)} with policy={self.policy!r}; raise memory_budget or lower batch_multiple."
            )
        self.cost = self._cost_at(best, static)
        rank_zero_info(f"lightning-ckpt: target_batch_size='max' -> {best} (multiple of {self.batch_multiple})")
        return plan

    def _cost_at(self, batch_size: int, static) -> StepCost:
        assert self.profile is not None
        return self.profile.at(
            batch_size,
            static_bytes=static.resident_bytes,
            optimizer_transient_bytes=static.optimizer_transient_bytes,
            grads_live_in_forward=True,
        )

    def _make_plan(self, cost: StepCost, static) -> Plan:
        budget = self._budget_bytes
        assert budget is not None
        try:
            plan = make_plan(cost, self.policy, budget, every_k=self.every_k, metric=self.cost_metric)
        except InfeasibleBudgetError:
            plan = None
        if plan is None or not plan.fits:
            largest = self._largest_feasible_batch(static)
            got = f"needs {format_bytes(plan.predicted_peak_bytes)}" if plan is not None else "cannot fit"
            hint = (
                f"the largest batch that fits with the best plan is {largest}"
                if largest
                else "not even batch size 1 fits (parameters, gradients and optimizer state take most of it)"
            )
            raise InfeasibleBudgetError(
                f"target_batch_size={self.target_batch_size} with policy={self.policy!r} {got}, over the "
                f"memory_budget of {format_bytes(budget)} even at the plan's best; {hint}. "
                "Lower target_batch_size or raise memory_budget."
            )
        return plan

    def _largest_feasible_batch(self, static: StaticMemory) -> int:
        best, _ = largest_batch(
            lambda b: self._cost_at(b, static), self._budget_bytes, "optimal", upper=self.target_batch_size,
            metric=self.cost_metric,
        )
        return best

    # ------------------------------------------------------------------ teardown and state
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        if self._applied is not None:
            self._applied.remove()
            self._applied = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": None if self.plan is None else self.plan.to_dict(),
            "profile": None if self.profile is None else self.profile.to_dict(),
            "cost": None if self.cost is None else self.cost.to_dict(),
            "signature": self._signature(),
            "budget_bytes": self._budget_bytes,
            "policy": self.policy,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)


def _reload_dataloaders(trainer: pl.Trainer) -> None:
    """Rebuild the train and val loaders after a batch size change (as BatchSizeFinder does)."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    val_loop = loop.epoch_loop.val_loop
    val_loop._combined_loader = None
    val_loop.setup_data()


def _static_memory(trainer: pl.Trainer, pl_module: pl.LightningModule):
    """Per-device static memory: the strategy's own model when it has one (ZeRO shards
    parameters, gradients and optimizer state), else what this process holds."""
    own = getattr(trainer.strategy, "ckpt_static_memory", None)
    if callable(own):
        return own(pl_module, trainer.optimizers)
    return static_memory(pl_module, trainer.optimizers)


def _profiling_context(trainer: pl.Trainer):
    """The strategy's context for profiling steps (DDP: no gradient sync)."""
    own = getattr(trainer.strategy, "ckpt_profiling_context", None)
    if callable(own):
        return own()
    no_sync = getattr(trainer.model, "no_sync", None)
    return no_sync() if callable(no_sync) else contextlib.nullcontext()


@contextlib.contextmanager
def _muted_logging(module: pl.LightningModule):
    """Profiling runs `training_step`: its `self.log` calls must not reach the loggers."""
    saved = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    module.log = lambda *a, **k: None  # type: ignore[method-assign]
    module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for k in ("log", "log_dict"):
            if k in saved:
                module.__dict__[k] = saved[k]
            else:
                module.__dict__.pop(k, None)
