"""A checkpoint's plan on resume: reused when it still matches the run, else planned again.

The callback's state holds the plan, its profile and cost, and what the plan depends on:
the blocks (names and parameter shapes), the budget and the policy. A mismatch is
reported and the run re-plans, or with `strict_resume` stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_ckpt.engine.checkpoint_engine import block_signature  # noqa: F401 - part of the checkpoint format
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.nested_model import depth_of
from lightning_ckpt.planning.plan import Plan


@dataclass(frozen=True)
class ResumedPlan:
    """A checkpoint's plan with the profile and cost it was made from (None when not saved)."""

    plan: Plan
    profile: Profile | None
    cost: StepCost | None


def callback_state(
    plan: Plan | None,
    profile: Profile | None,
    cost: StepCost | None,
    signature: list[list[Any]],
    budget_bytes: int | None,
    policy: str,
) -> dict[str, Any]:
    """The callback's state in a checkpoint: the plan, what it was made from and what it depends on."""
    return {
        "plan": None if plan is None else plan.to_dict(),
        "profile": None if profile is None else profile.to_dict(),
        "cost": None if cost is None else cost.to_dict(),
        "signature": signature,
        "budget_bytes": budget_bytes,
        "policy": policy,
    }


def resumed_plan(
    loaded: dict[str, Any] | None,
    signature: list[list[Any]],
    target_batch_size: int | str,
    budget_bytes: int | None,
    policy: str,
    *,
    strict: bool,
    granularity: str = "block",
    max_levels: int = 2,
) -> ResumedPlan | None:
    """The plan of a loaded callback state when it matches this run; None to plan again."""
    if not loaded or loaded.get("plan") is None:
        return None
    plan = Plan.from_dict(loaded["plan"])
    problems = []
    if loaded.get("signature") != signature:
        problems.append(
            f"the blocks changed (checkpoint: {len(loaded.get('signature') or [])} blocks, "
            f"now: {len(signature)} blocks or different parameter shapes)"
        )
    if target_batch_size != "max" and plan.batch_size != target_batch_size:
        problems.append(f"the plan is for batch {plan.batch_size}, target_batch_size is {target_batch_size}")
    if loaded.get("budget_bytes") != budget_bytes or loaded.get("policy") != policy:
        problems.append("memory_budget or policy changed")
    if plan.granularity != granularity:
        problems.append(f"the plan is at granularity {plan.granularity!r}, granularity is {granularity!r}")
    levels = depth_of(plan.segments, plan.inner_segments)
    if levels > max_levels:
        problems.append(f"the plan nests segments {levels} levels deep, max_levels is {max_levels}")
    if problems:
        msg = f"lightning-ckpt: the checkpoint's plan does not match this run: {'; '.join(problems)}."
        if strict:
            raise ValueError(msg + " strict_resume=True, so stopping; set strict_resume=False to plan again.")
        rank_zero_info(msg + " Planning again.")
        return None
    profile = None if loaded.get("profile") is None else Profile.from_dict(loaded["profile"])
    cost = None if loaded.get("cost") is None else StepCost.from_dict(loaded["cost"])
    return ResumedPlan(plan, profile, cost)
