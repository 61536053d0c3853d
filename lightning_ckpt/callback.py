"""`ActivationCheckpointing`: the Lightning callback that profiles, plans and applies.

At the start of fit it sets the loader to `target_batch_size` (as Lightning's
`BatchSizeFinder` does), then on the first training batch it profiles the step on
small slices of that batch, plans for the target within `memory_budget`, applies
the plan, prints the plan table on rank 0 and logs its prediction. All the work
is done by the pure core; this module only gathers inputs and applies results.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from lightning_ckpt.apply import AppliedPlan, apply_segments
from lightning_ckpt.blocks import resolve_blocks
from lightning_ckpt.costs import StepCost
from lightning_ckpt.plan import Plan, format_bytes
from lightning_ckpt.planner import COST_METRICS, POLICIES, InfeasibleBudgetError, make_plan
from lightning_ckpt.profile import Profile
from lightning_ckpt.profiler import batch_size_of, profile_model
from lightning_ckpt.static_memory import static_memory
from lightning_ckpt.units import parse_bytes

DEFAULT_CUDA_FRACTION = 0.9


def _positive_int(value: Any, name: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; {hint}")
    return value


class ActivationCheckpointing(Callback):
    """Checkpoint the blocks of a model so training at `target_batch_size` fits `memory_budget`.

    Args:
        target_batch_size: per-device batch size to train at; the train loader is set to it.
        memory_budget: per-device peak allowed for the whole step (parameters, gradients,
            optimizer state, activations), bytes or a string like ``"6GiB"``. Default on
            CUDA: 90% of the device's memory; on CPU it must be given.
        blocks: dotted path to the ordered container of blocks (``"encoder.layers"``), or
            None to pick the largest container of same-class modules.
        policy: ``optimal`` (least recompute that fits), ``greedy``, ``sqrt``, ``every_k``,
            ``full`` or ``none``.
        every_k: blocks per segment for ``policy="every_k"``; None picks the smallest k that fits.
        cost_metric: what recompute is measured in when choosing: ``flops`` or ``ms``.
        batch_arg_name: attribute holding the loader's batch size (module, hparams or datamodule).
        probe_batch_sizes: the two small batch sizes profiled; bytes are fitted as a line in them.
        check_batch_size: a third size that checks the line (None to skip).
        guard_batchnorm: keep BatchNorm statistics from being updated by a recompute.
        verbose: print the plan table on rank 0.
    """

    POLICIES = POLICIES

    def __init__(
        self,
        target_batch_size: int,
        memory_budget: int | str | None = None,
        blocks: str | None = None,
        policy: str = "optimal",
        every_k: int | None = None,
        cost_metric: str = "flops",
        batch_arg_name: str = "batch_size",
        probe_batch_sizes: tuple[int, int] = (1, 2),
        check_batch_size: int | None = 4,
        guard_batchnorm: bool = True,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        self.target_batch_size = _positive_int(
            target_batch_size, "target_batch_size", "it is the per-device batch size to train at."
        )
        self.memory_budget = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is not a known policy; choose one of {', '.join(POLICIES)}.")
        self.policy = policy
        if blocks is not None and (not isinstance(blocks, str) or not blocks.strip()):
            raise ValueError(f"blocks={blocks!r} must be a dotted path such as 'encoder.layers', or None to auto-detect.")
        self.blocks = blocks
        if every_k is not None:
            _positive_int(every_k, "every_k", "it is the number of blocks per checkpointed segment.")
            if policy != "every_k":
                raise ValueError(f"every_k={every_k} only applies to policy='every_k', but policy={policy!r}; drop every_k or set policy='every_k'.")
        self.every_k = every_k
        if cost_metric not in COST_METRICS:
            raise ValueError(f"cost_metric={cost_metric!r} is not known; choose 'flops' (deterministic) or 'ms' (measured time).")
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
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            return  # checked against the first batch instead
        current = lightning_getattr(pl_module, self.batch_arg_name)
        if current == self.target_batch_size:
            return
        lightning_setattr(pl_module, self.batch_arg_name, self.target_batch_size)
        rank_zero_info(f"lightning-ckpt: {self.batch_arg_name} {current} -> {self.target_batch_size} (target_batch_size)")
        loop = trainer.fit_loop
        loop._combined_loader = None
        loop.setup_data()
        val_loop = loop.epoch_loop.val_loop
        val_loop._combined_loader = None
        val_loop.setup_data()

    # ------------------------------------------------------------------ plan and apply
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._applied is not None:
            return
        n = batch_size_of(batch)
        if n != self.target_batch_size:
            raise ValueError(
                f"the first training batch has {n} samples but target_batch_size={self.target_batch_size}; "
                f"lightning-ckpt sets the loader's batch size through the attribute {self.batch_arg_name!r} on the "
                "LightningModule, its hparams or the datamodule, and none was found or the loader ignores it. "
                f"Expose {self.batch_arg_name!r} (or set batch_arg_name) or build the loader with the target batch size."
            )
        plan = self._plan_from_checkpoint() or self._profile_and_plan(trainer, pl_module, batch, batch_idx)
        plan = Plan.from_dict(trainer.strategy.broadcast(plan.to_dict(), src=0))
        self.plan = plan
        self._applied = apply_segments(self._blocks, plan.segments, guard_batchnorm=self.guard_batchnorm)
        if self.verbose:
            rank_zero_info(str(plan))
        metrics = {
            "ckpt/predicted_peak_bytes": float(plan.predicted_peak_bytes),
            "ckpt/recompute_share": float(plan.recompute_share),
            "ckpt/checkpointed_blocks": float(len(plan.checkpointed)),
        }
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _plan_from_checkpoint(self) -> Plan | None:
        loaded, self._loaded = self._loaded, None
        if not loaded or loaded.get("plan") is None:
            return None
        plan = Plan.from_dict(loaded["plan"])
        if plan.n_blocks != len(self._blocks) or plan.batch_size != self.target_batch_size:
            rank_zero_info(
                f"lightning-ckpt: the checkpoint's plan is for {plan.n_blocks} blocks at batch {plan.batch_size}; "
                f"this run has {len(self._blocks)} blocks at batch {self.target_batch_size}: planning again."
            )
            return None
        if loaded.get("profile") is not None:
            self.profile = Profile.from_dict(loaded["profile"])
        return plan

    def _profile_and_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> Plan:
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
        err = self.profile.check_error()
        if err > 0.05:
            rank_zero_info(
                f"lightning-ckpt: bytes predicted from batches {probes} miss the measurement at batch {check} by "
                f"{100 * err:.1f}%; the model's memory is not linear in the batch size, so the plan may be off."
            )
        static = _static_memory(trainer, pl_module)
        self.cost = self._cost_at(self.target_batch_size, static)
        return self._make_plan(self.cost, static)

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

    def _largest_feasible_batch(self, static) -> int:
        def fits(b: int) -> bool:
            try:
                make_plan(self._cost_at(b, static), "optimal", self._budget_bytes, metric=self.cost_metric)
                return True
            except InfeasibleBudgetError:
                return False

        lo, hi = 0, self.target_batch_size  # fits(lo) (vacuous), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    # ------------------------------------------------------------------ teardown and state
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._applied is not None:
            self._applied.remove()
            self._applied = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": None if self.plan is None else self.plan.to_dict(),
            "profile": None if self.profile is None else self.profile.to_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)


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
