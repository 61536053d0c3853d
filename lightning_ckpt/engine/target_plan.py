"""The callback's plan for its target: a fixed batch size within the budget, or the largest that fits.

Plain functions over the fitted profile and the per-device static memory. When the target
cannot fit they raise `InfeasibleBudgetError` naming the largest batch that would; when what the
strategy keeps in host memory (ZeRO-Offload, FSDP2's CPU offloading) is over the host budget, they
raise it naming both, before any planning. A plan carries the host and NVMe bytes beside its peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from lightning_ckpt.planning.capacity import largest_batch
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.units import format_bytes
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan
from lightning_ckpt.profiling.structure.shapes import BatchShape
from lightning_ckpt.profiling.memory.static_memory import StaticMemory


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked of the plan: the per-device budget and how to choose."""

    budget_bytes: int
    policy: str
    every_k: int | None
    cost_metric: str
    granularity: str = "block"
    max_levels: int = 2  # policy="optimal" may nest segments this deep
    host_budget_bytes: int | None = None  # per-rank host memory for what the strategy offloads; None: unchecked


def cost_at(profile: Profile, batch_size: int, static: StaticMemory) -> StepCost:
    """The whole step's cost at `batch_size`: the fitted activations plus the static memory."""
    return profile.at(
        batch_size,
        static_bytes=static.resident_bytes,
        optimizer_transient_bytes=static.optimizer_transient_bytes,
        grads_live_in_forward=True,
        grads_on_device=static.grads_on_device,
    )


def check_host_memory(static: StaticMemory, request: PlanRequest) -> None:
    """InfeasibleBudgetError when what the strategy keeps in host memory for this rank is over
    `request.host_budget_bytes` (nothing to check without offloading or without a host budget)."""
    host, budget = static.host_bytes, request.host_budget_bytes
    if budget is None or host <= budget:
        return
    each = ", ".join(f"{what} {format_bytes(n)}" for what, n in static.host_parts)
    raise InfeasibleBudgetError(
        f"the strategy keeps {format_bytes(host)} per rank in host memory ({each}), over the host budget of "
        f"{format_bytes(budget)}: the host cannot hold what is offloaded to it. Raise host_memory_budget, "
        "train on more ranks (the offloaded state is partitioned over them) or offload to NVMe."
    )


def with_offloaded(plan: Plan, static: StaticMemory) -> Plan:
    """`plan` with what the strategy keeps in host memory and on NVMe beside its device peak."""
    if not static.host_bytes and not static.nvme_bytes:
        return plan
    return dataclasses.replace(plan, host_bytes=static.host_bytes, nvme_bytes=static.nvme_bytes)


def plan_for_target(profile: Profile, static: StaticMemory, request: PlanRequest, target: int) -> tuple[Plan, StepCost]:
    """The plan at batch `target` and its cost; InfeasibleBudgetError when it does not fit."""
    check_host_memory(static, request)
    cost = cost_at(profile, target, static)
    try:
        plan = make_plan(
            cost, request.policy, request.budget_bytes, every_k=request.every_k, metric=request.cost_metric,
            granularity=request.granularity, max_levels=request.max_levels,
        )
    except InfeasibleBudgetError:
        plan = None
    if plan is not None and plan.fits:
        return with_offloaded(plan, static), cost
    largest, _ = largest_batch(  # for the policy asked for: the batch that would fit as configured
        lambda b: cost_at(profile, b, static), request.budget_bytes, request.policy, upper=target,
        every_k=request.every_k, metric=request.cost_metric, granularity=request.granularity,
        max_levels=request.max_levels,
    )
    got = f"needs {format_bytes(plan.predicted_peak_bytes)}" if plan is not None else "cannot fit"
    levels = (
        " and max_levels=1 (raise it to let segments be rebuilt inside nested segments, which holds fewer boundaries)"
        if request.policy == "optimal" and request.max_levels == 1
        else ""
    )
    if largest:
        hint = f"the largest batch that fits with policy={request.policy!r} is {largest}"
    else:
        hint = f"not even batch size 1 fits: {state_in_budget(static, request.budget_bytes)[1]}"
    raise InfeasibleBudgetError(
        f"target_batch_size={target} with policy={request.policy!r}{levels} {got}, over the memory_budget of "
        f"{format_bytes(request.budget_bytes)} even at the plan's best; {hint}. "
        "Lower target_batch_size or raise memory_budget."
    )


def state_in_budget(static: StaticMemory, budget_bytes: int) -> tuple[int, str]:
    """(what the budget leaves beside the model's state, below zero when over it; that in words, term by term)."""
    parts = [("parameters", static.param_bytes), ("buffers", static.buffer_bytes),
             ("gradients", static.grad_bytes), ("optimizer state", static.optimizer_state_bytes),
             ("the strategy's buffers", static.comm_buffer_bytes)]
    static_bytes = sum(nbytes for _, nbytes in parts)
    each = ", ".join(f"{what} {format_bytes(nbytes)}" for what, nbytes in parts if nbytes)
    left = budget_bytes - static_bytes
    said = (
        f"the model's state takes {format_bytes(static_bytes)} of the {format_bytes(budget_bytes)} budget"
        + (f" ({each})" if each else "") + ", "
        + (f"{format_bytes(-left)} over it before any activation" if left < 0
           else f"which leaves {format_bytes(left)} for the activations of one sample")
    )
    return left, said


def refuse_state_over_budget(static: StaticMemory, budget_bytes: int | None, what: str) -> None:
    """InfeasibleBudgetError, before any pass, when the model's state alone is over the budget (`what`: the batch)."""
    if budget_bytes is None:
        return
    left, said = state_in_budget(static, budget_bytes)
    if left < 0:
        raise InfeasibleBudgetError(
            f"{what}: no plan fits memory_budget={format_bytes(budget_bytes)}, not even batch size 1 fits: {said}. "
            "Shard or offload the state (ZeRO, FSDP2, ZeRO-Offload) or raise memory_budget."
        )


def plan_for_max(profile: Profile, static: StaticMemory, request: PlanRequest, multiple: int) -> tuple[Plan, StepCost]:
    """The plan at the largest multiple of `multiple` that fits, and its cost."""
    check_host_memory(static, request)
    best, plan = largest_batch(
        lambda b: cost_at(profile, b, static), request.budget_bytes, request.policy, multiple,
        every_k=request.every_k, metric=request.cost_metric, granularity=request.granularity,
        max_levels=request.max_levels,
    )
    if plan is None:
        raise InfeasibleBudgetError(
            f"target_batch_size='max': not even batch size {multiple} fits memory_budget="
            f"{format_bytes(request.budget_bytes)} with policy={request.policy!r}; raise memory_budget or lower "
            "batch_multiple."
        )
    return with_offloaded(plan, static), cost_at(profile, best, static)


def plan_for_max_at(
    profile: Profile, static: StaticMemory, request: PlanRequest, multiple: int, shape: BatchShape,
    held_note: Callable[[], str], info: Callable[[str], None],
) -> tuple[Plan, StepCost]:
    """`plan_for_max` for the profiled batch of `shape`, said in one line to `info`; when nothing fits, the
    error adds `held_note()` (the blocks kept for the Python state they write) unless it names them already."""
    try:
        plan, cost = plan_for_max(profile, static, request, multiple)
    except InfeasibleBudgetError as err:
        if "allow_python_state" in str(err) or not held_note():
            raise
        raise InfeasibleBudgetError(f"{err}{held_note()}") from None
    info(
        f"lightning-ckpt: target_batch_size='max' -> {plan.batch_size} (a multiple of {multiple}) "
        f"at the shape of the profiled batch ({shape.describe()}); batches of other shapes are planned "
        "when they arrive at that size, and one that cannot fit stops the run before its step."
    )
    return plan, cost


def fits_target(profile: Profile, static: StaticMemory, request: PlanRequest, target: int) -> bool:
    """Whether a plan at batch `target` fits the request's budget (`plan_for_target`, without its error)."""
    try:
        return plan_for_target(profile, static, request, target)[0].fits
    except InfeasibleBudgetError:
        return False


def batch_error(err: InfeasibleBudgetError, shape: BatchShape, note: str, longest: int | None) -> InfeasibleBudgetError:
    """`err` said of the training batch of `shape`, with `note` and, for one sequence, the `longest` length
    that fits (which says more than a batch size)."""
    if longest is not None:
        note += (f" At batch 1 the longest sequence (or packed row) that fits is {longest} tokens; "
                 "cut or pack the sequences to that length.")
    return InfeasibleBudgetError(f"the training batch of shape ({shape.describe()}): {err}{note}")
