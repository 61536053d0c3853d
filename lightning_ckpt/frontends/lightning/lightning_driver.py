"""The engine's `StepDriver` under a Lightning `Trainer`: the module's own `training_step` profiled
(`profile_step`), the strategy's static memory and collectives, Lightning's rank-zero messages."""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ckpt.apply.segments import AppliedPlan
from lightning_ckpt.frontends.lightning import compiled
from lightning_ckpt.frontends.lightning.backward_grads import BackwardGrads
from lightning_ckpt.frontends.lightning.profile_step import calls_of_first_batch, chain_of_first_batch, profile_first_batch
from lightning_ckpt.frontends.lightning.strategy_hooks import strategy_static_memory
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.profiling.structure.blocks import resolve_blocks
from lightning_ckpt.profiling.structure.discovery import ChainChoice
from lightning_ckpt.profiling.passes.profile_budget import ProfileBudget
from lightning_ckpt.engine.engine_inputs import reading_room
from lightning_ckpt.profiling.memory.static_memory import StaticMemory


class LightningDriver:
    """Profiling, static memory, collectives and messages of one `trainer`'s fit. The trainer is held weakly:
    the engine that keeps this driver after the fit (to show its plan) keeps neither the trainer nor its model."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = weakref.ref(trainer)
        module = trainer.lightning_module
        self.backward_grads = None if module is None else BackwardGrads(module)

    @property
    def trainer(self) -> pl.Trainer:
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError(
                "lightning-ckpt: the Trainer this engine was planning for no longer exists; a new fit binds the "
                "callback to its own Trainer (at its first training batch, or at fit start when blocks are named)."
            )
        return trainer

    @property
    def rank(self) -> int:
        return self.trainer.global_rank

    @property
    def grads_accumulate(self) -> bool:
        """Every gradient alive through the step: accumulation, or a module seen (or assumed) to keep them
        (`backward_grads`)."""
        kept = self.backward_grads is not None and self.backward_grads.state
        return self.trainer.accumulate_grad_batches > 1 or kept

    @property
    def grads_reason(self) -> str | None:
        """What changed the gradients the plans count, for the message (`engine.step_grads.follow`)."""
        if self.trainer.accumulate_grad_batches > 1 or self.backward_grads is None or self.backward_grads.kept is None:
            return None
        return self.backward_grads.describe()

    def observe_backward(self, pl_module: pl.LightningModule) -> None:
        """Read the gradients at a backward's start (not under accumulation, where they are kept anyway)."""
        if self.backward_grads is not None and self.trainer.accumulate_grad_batches == 1:
            self.backward_grads.observe([p for p in pl_module.parameters() if p.requires_grad])

    @property
    def grads_live_in_forward(self) -> bool:
        """Automatic optimization zeroes the gradients after the training step's forward (`set_to_none=True`)."""
        return True

    def chain(
        self, pl_module: pl.LightningModule, blocks: str | list[str] | None, batch: Any, budget_bytes: int | None = None,
    ) -> tuple[list[str], list[torch.nn.Module]] | ChainChoice:
        """The blocks `blocks` names; with None, the chains `batch`'s step offers at each level of the module
        tree (`profiling.structure.discovery`: the engine plans them to choose; read within `budget_bytes`), said once."""
        if blocks is not None:
            _, names, modules = resolve_blocks(pl_module, blocks)
            return names, modules
        choice = chain_of_first_batch(self.trainer, pl_module, batch, reading_room(self, budget_bytes, pl_module, batch))
        rank_zero_info(f"lightning-ckpt: {choice}")
        return choice

    def call_chain(
        self, batch: Any, modules: list[torch.nn.Module], names: list[str]
    ) -> tuple[list[torch.nn.Module], list[str]]:
        return calls_of_first_batch(self.trainer, self.trainer.lightning_module, modules, names, batch)

    def profile(
        self, batch: Any, blocks: list[torch.nn.Module], names: list[str], *, batch_idx: int,
        probes: tuple[int, int], check: int | None, rates: MachineRates | None, calibrate_keeps: bool,
        time_blocks: bool = True, budget: ProfileBudget | None = None,
    ) -> Profile:
        trainer = self.trainer
        return profile_first_batch(
            trainer, trainer.lightning_module, blocks, names, batch, batch_idx, probes, check,
            calibrate_keeps=calibrate_keeps, rates=rates, time_blocks=time_blocks, budget=budget,
        )

    def static_memory(self) -> StaticMemory:
        return strategy_static_memory(self.trainer, self.trainer.lightning_module)

    def optimizer_state_exists(self) -> bool:
        """Whether any optimizer's state exists yet (most create it in their first step)."""
        return any(bool(getattr(o, "state", True)) for o in self.trainer.optimizers)

    def broadcast(self, obj: Any) -> Any:
        return self.trainer.strategy.broadcast(obj, src=0)

    def all_gather(self, obj: Any) -> list[Any]:
        if not (self.trainer.world_size > 1 and dist.is_available() and dist.is_initialized()):
            return [obj]
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, obj)
        return found

    def apply(self, blocks: list[torch.nn.Module], names: list[str], plan: Plan, guard_batchnorm: bool) -> AppliedPlan:
        return compiled.apply_plan(self.trainer.lightning_module, blocks, names, plan, guard_batchnorm)

    def info(self, message: str) -> None:
        rank_zero_info(message)

    def warn(self, message: str) -> None:
        rank_zero_warn(message)
