"""The engine's `StepDriver` for a loop the user writes: plain PyTorch, or Fabric after `fabric.setup`.

A step is the user's `step_fn(batch)`, which returns the loss; profiling runs its backward and puts
every state back (`profiling.passes.profiler`). What the loop does with its gradients between steps is read at
each step's start (`observe_grads`, `loop_grads`). Wrappers are seen through: Fabric's `_FabricModule`,
`DistributedDataParallel` (profiling runs inside its `no_sync`, so no gradient is reduced) and a
Fabric optimizer. With `torch.distributed` initialised (Fabric, torchrun) rank 0 plans and every
rank takes its plan; collectives are `torch.distributed`'s object collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_ckpt.apply.segments import AppliedPlan, apply_segments
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.profiling.structure.batch import batch_size_of, checked_size, slice_batch
from lightning_ckpt.profiling.memory.ddp_memory import ddp_comm_buffer_bytes
from lightning_ckpt.profiling.passes.profile_budget import ProfileBudget
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.frontends.loops.loop_grads import LoopGradients, StepGrads
from lightning_ckpt.profiling.structure.block_calls import call_chain
from lightning_ckpt.profiling.forward_state.state import preserved_rng, preserved_state, unchanged_parameters
from lightning_ckpt.profiling.memory.static_memory import StaticMemory, static_memory

StepFn = Callable[[Any], torch.Tensor]


def unwrap_module(model: nn.Module) -> nn.Module:
    """The user's module under Fabric's wrapper, DDP and `torch.compile`."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = None
        if type(model).__name__ == "_FabricModule":
            inner = getattr(model, "_original_module", None) or getattr(model, "module", None)
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        elif hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            inner = model._orig_mod
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def ddp_module(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The `DistributedDataParallel` in `model`'s wrappers, if any."""
    for m in (model, getattr(model, "_forward_module", None), getattr(model, "module", None)):
        if isinstance(m, nn.parallel.DistributedDataParallel):
            return m
    return None


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under Fabric's `_FabricOptimizer` (None stays None)."""
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer (nor a wrapper with one in "
                "`.optimizer`); pass the optimizer your loop steps, or optimizer_state_bytes= its state's size."
            )
        optimizer = inner
    return optimizer


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class PlainDriver:
    """Profiling through `step_fn`, static memory from the module and the optimizer, collectives of
    `torch.distributed` when it is initialised; messages through `info` / `warn`."""

    def __init__(
        self,
        model: nn.Module,
        step_fn: StepFn,
        optimizer: torch.optim.Optimizer | None,
        optimizer_state_bytes: int | None = None,
        grads_accumulate: bool = False,
        info: Callable[[str], None] = print,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.wrapped, self.model = model, unwrap_module(model)
        self.step_fn, self.optimizer = step_fn, unwrap_optimizer(optimizer)
        self.optimizer_state_bytes = optimizer_state_bytes
        self.accumulating = grads_accumulate  # said by the user: several backward passes per optimizer step
        self.loop_grads = LoopGradients()
        self._info, self._warn = info, warn
        self.profiling = False  # True while a profile runs (the front end's shape guard stays quiet)

    @property
    def rank(self) -> int:
        return dist.get_rank() if distributed() else 0

    def observe_grads(self) -> None:
        """Read the parameters' gradients at the start of a step (`loop_grads.LoopGradients.observe`)."""
        self.loop_grads.observe(p for p in self.model.parameters() if p.requires_grad)

    @property
    def grads_accumulate(self) -> bool:
        """Every gradient is alive through the step: accumulation said, or gradients seen kept between steps."""
        return self.accumulating or self.loop_grads.state == StepGrads.KEPT

    @property
    def grads_live_in_forward(self) -> bool:
        """Last step's gradients are alive in the forward (seen at a step's start)."""
        return self.accumulating or self.loop_grads.state >= StepGrads.FORWARD

    @property
    def grads_reason(self) -> str | None:
        """What changed the gradients the plans count, for the message (`engine.step_grads.follow`)."""
        return None if self.accumulating else self.loop_grads.state.describe()

    def profile(
        self, batch: Any, blocks: list[nn.Module], names: list[str], *, batch_idx: int,
        probes: tuple[int, int], check: int | None, rates: MachineRates | None, calibrate_keeps: bool,
        time_blocks: bool = True, budget: ProfileBudget | None = None,
    ) -> Profile:
        check = checked_size(batch, probes, check, self.info)
        ddp = ddp_module(self.wrapped)
        self.profiling = True
        try:
            no_sync = ddp.no_sync() if ddp is not None else contextlib.nullcontext()
            with preserved_rng(), unchanged_parameters(self.model), no_sync:  # the RNG as found, whatever profiling ran
                return profile_model(
                    self.model, blocks, self.step_fn, batch, probes, check, names=names,
                    calibrate_keeps=calibrate_keeps, rates=rates, time_blocks=time_blocks, budget=budget,
                )
        finally:
            self.profiling = False

    def call_chain(self, batch: Any, modules: list[nn.Module], names: list[str]) -> tuple[list[nn.Module], list[str]]:
        """The chain of calls one step makes of `modules` (`profiling.structure.block_calls`), read on two samples of `batch`."""
        ddp = ddp_module(self.wrapped)
        self.profiling = True
        try:
            no_sync = ddp.no_sync() if ddp is not None else contextlib.nullcontext()
            with preserved_rng(), preserved_state(self.model), no_sync:
                return call_chain(self.model, modules, names, self.step_fn, slice_batch(batch, min(2, batch_size_of(batch))))
        finally:
            self.profiling = False

    def static_memory(self) -> StaticMemory:
        """The module's and the optimizer's state, and DDP's gradient buckets when DDP wraps it."""
        static = static_memory(self.model, [] if self.optimizer is None else [self.optimizer])
        if self.optimizer_state_bytes is not None:
            static = dataclasses.replace(static, optimizer_state_bytes=self.optimizer_state_bytes)
        return dataclasses.replace(static, comm_buffer_bytes=ddp_comm_buffer_bytes(self.wrapped))

    def optimizer_state_exists(self) -> bool:
        """Whether the optimizer's state exists yet (most create it in their first step)."""
        return self.optimizer is None or bool(self.optimizer.state)

    def broadcast(self, obj: Any) -> Any:
        if not distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not distributed():
            return [obj]
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, obj)
        return found

    def apply(self, blocks: list[nn.Module], names: list[str], plan: Plan, guard_batchnorm: bool) -> AppliedPlan:
        return apply_segments(
            blocks, plan.segments, guard_batchnorm=guard_batchnorm, keep_ops=plan.keep_ops,
            inner_segments=plan.inner_segments,
        )

    def info(self, message: str) -> None:
        if self.rank == 0:
            self._info(message)

    def warn(self, message: str) -> None:
        if self.rank == 0:
            (self._warn or (lambda m: warnings.warn(m, stacklevel=3)))(message)
