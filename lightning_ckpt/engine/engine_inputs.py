"""What the engine is given: the settings a front end plans with (`EngineSettings`, the callback's
arguments), how it runs a step (`StepDriver`), and the per-block facts a plan depends on (which blocks
may repeat their Python state writes in a recompute, and the blocks' signature a stored plan refers to).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_ckpt.apply.segments import AppliedPlan
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.engine.target_plan import PlanRequest, refuse_state_over_budget
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.profiling.passes.profile_budget import ProfileBudget, SliceRoom
from lightning_ckpt.profiling.memory.static_memory import StaticMemory
from lightning_ckpt.profiling.structure.shapes import shape_of


@dataclass(frozen=True)
class EngineSettings:
    """How to plan: the per-device budget, the policy and the profiling sizes (the callback's arguments)."""

    budget_bytes: int
    policy: str = "optimal"
    every_k: int | None = None
    cost_metric: str = "time"
    granularity: str = "block"
    max_levels: int = 2
    probe_batch_sizes: tuple[int, int] = (1, 2)
    check_batch_size: int | None = 4
    guard_batchnorm: bool = True
    batch_multiple: int = 1
    keep_hf_checkpointing: bool = False  # leave a model's own (HF) activation checkpointing in charge
    # let blocks whose forward writes Python state be checkpointed: True (all) or their names
    allow_python_state: bool | tuple[str, ...] = False
    host_budget_bytes: int | None = None  # per-rank host memory for what the strategy offloads; None: unchecked

    def request(self) -> PlanRequest:
        return PlanRequest(
            self.budget_bytes, self.policy, self.every_k, self.cost_metric, self.granularity, self.max_levels,
            self.host_budget_bytes,
        )


class StepDriver(Protocol):
    """What a front end gives the engine."""

    rank: int
    grads_accumulate: bool  # every gradient is alive through the step (an earlier micro-batch's, or kept zeroed)
    grads_live_in_forward: bool  # last step's gradients are alive in the forward (`engine.step_grads`)

    def profile(
        self, batch: Any, blocks: list[torch.nn.Module], names: list[str], *, batch_idx: int,
        probes: tuple[int, int], check: int | None, rates: MachineRates | None, calibrate_keeps: bool,
        time_blocks: bool = True, budget: ProfileBudget | None = None,
    ) -> Profile:
        """One profile of the step on slices of `batch`, every state put back (`time_blocks`: each
        block's forward timed too; `budget`: every pass within it, `profiling.passes.profile_budget`)."""

    def call_chain(
        self, batch: Any, modules: list[torch.nn.Module], names: list[str]
    ) -> tuple[list[torch.nn.Module], list[str]]:
        """The chain of calls one step on `batch` makes of `modules` (`profiling.structure.block_calls.call_chain`)."""

    def static_memory(self) -> StaticMemory: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the object itself on one process)."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` in rank order (`[obj]` on one process)."""

    def apply(self, blocks: list[torch.nn.Module], names: list[str], plan: Plan, guard_batchnorm: bool) -> AppliedPlan: ...

    def info(self, message: str) -> None: ...

    def warn(self, message: str) -> None: ...


def reading_room(driver: StepDriver, budget_bytes: int | None, model: torch.nn.Module, batch: Any) -> SliceRoom | None:
    """The room the forward that reads which blocks there are (`profiling.structure.discovery`) may hold beside `batch`:
    profiling's (the budget less the static memory, the optimizer state once it exists, the gradients alive
    and the batch); None without a budget. A model whose state alone is over the budget is refused here."""
    if budget_bytes is None:
        return None
    static = driver.static_memory()
    refuse_state_over_budget(static, budget_bytes, f"the training batch of shape ({shape_of(batch).describe()})")
    state = getattr(driver, "optimizer_state_exists", lambda: True)()  # none before the first step
    resident = static.resident_bytes - (0 if state else static.optimizer_state_bytes)
    return ProfileBudget(budget_bytes, resident).room_for(model, batch)


def allowed_python_state(profile: Profile, allow: bool | Sequence[str], names: Sequence[str]) -> Profile:
    """`profile` with the Python state writes of the blocks in `allow` (True: every block) forgotten
    (`BlockCost.unreplayable`), so that planning may checkpoint them: the user says the writes are
    harmless when a recompute repeats them."""
    if allow is False or not allow:
        return profile
    unknown = [] if allow is True else sorted(set(allow) - set(names))
    if unknown:
        raise ValueError(
            f"allow_python_state names {unknown}, which are not blocks of this model; the blocks are "
            f"{list(names)}. Give block names from that list, or True for every block."
        )
    allowed = set(names) if allow is True else set(allow)

    def forget(cost: StepCost) -> StepCost:
        blocks = tuple(dataclasses.replace(b, unreplayable=()) if b.name in allowed else b for b in cost.blocks)
        return dataclasses.replace(cost, blocks=blocks)

    return dataclasses.replace(
        profile, probes=tuple(forget(p) for p in profile.probes),
        check=None if profile.check is None else forget(profile.check),
    )


def unchained(profile: Profile) -> Profile:
    """`profile` with no block chaining from the one before (`BlockCost.chains_from_previous`): every segment
    is one block, as needed when blocks may be skipped in training (LayerDrop: `profiling.structure.layer_skipping`)."""

    def cut(cost: StepCost) -> StepCost:
        blocks = tuple(dataclasses.replace(b, chains_from_previous=False) if i else b for i, b in enumerate(cost.blocks))
        return dataclasses.replace(cost, blocks=blocks)

    return dataclasses.replace(
        profile, probes=tuple(cut(p) for p in profile.probes), check=None if profile.check is None else cut(profile.check)
    )


def block_signature(names: Sequence[str], blocks: Sequence[torch.nn.Module]) -> list[list[Any]]:
    """[name, parameter shapes] of every block: what a plan's segments refer to."""
    return [[name, [list(p.shape) for p in blk.parameters()]] for name, blk in zip(names, blocks)]
