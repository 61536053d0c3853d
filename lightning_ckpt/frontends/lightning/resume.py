"""A checkpoint's plan on resume: used only while it still holds for this run, else planned again.

The callback's state holds the plan with the step cost it was made from and the batch shape it was
made for, the first profile with the shape it was made at, and what the plan depends on: the blocks
(names and parameter shapes), the budget and the policy. Before anything in it is used it is checked:
every field's type and range (`stored_state`), the segments against the chain, the plan's predicted
peak against the memory model for its own cost and, with this run's static memory, against the
budget. The plan is used only for the batch shape it was made for; a batch of another shape is
profiled and planned as any new shape is, the stored profile kept at the shape it was made at.
Anything that does not hold is said in one line naming the checkpoint and the run plans again, or
with `strict_resume` stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ckpt.engine.engine_inputs import block_signature  # noqa: F401 - part of the checkpoint format
from lightning_ckpt.engine.shape_plans import sample_key
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.frontends.lightning.stored_state import summary, value_problems
from lightning_ckpt.planning.memory_model import predict_peak, segment_of, validate_segments
from lightning_ckpt.planning.nested_model import depth_of, validate_nested
from lightning_ckpt.planning.op_options import validate_keeps
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.profiling.structure.shapes import BatchShape
from lightning_ckpt.profiling.memory.static_memory import StaticMemory
from lightning_ckpt.units import format_bytes

# the callback state's entries and their types (each plain data as its `to_dict` writes it)
_STATE_TYPES: dict[str, Any] = {
    "plan": Plan, "cost": StepCost | None, "profile": Profile | None, "shape": BatchShape | None,
    "profile_shape": BatchShape | None, "budget_bytes": int | None, "policy": str,
}


@dataclass(frozen=True)
class ResumedPlan:
    """What a checkpoint gives this run: its plan and cost when they hold for this batch's shape (else
    None), and its profile with the shape that profile was made at (None when not kept)."""

    plan: Plan | None
    profile: Profile | None
    cost: StepCost | None
    shape: BatchShape | None = None  # the shape the plan was made for
    profile_shape: BatchShape | None = None


def callback_state(
    plan: Plan | None,
    profile: Profile | None,
    cost: StepCost | None,
    signature: list[list[Any]],
    budget_bytes: int | None,
    policy: str,
    shape: BatchShape | None = None,
    profile_shape: BatchShape | None = None,
) -> dict[str, Any]:
    """The callback's state in a checkpoint: the plan, what it was made from and for, what it depends on."""
    return {
        "plan": None if plan is None else plan.to_dict(),
        "profile": None if profile is None else profile.to_dict(),
        "cost": None if cost is None else cost.to_dict(),
        "shape": None if shape is None else shape.to_dict(),
        "profile_shape": None if profile_shape is None else profile_shape.to_dict(),
        "signature": signature,
        "budget_bytes": budget_bytes,
        "policy": policy,
    }


def resumed_plan(
    loaded: Any,
    signature: list[list[Any]],
    target_batch_size: int | str,
    budget_bytes: int | None,
    policy: str,
    *,
    strict: bool,
    shape: BatchShape,
    static: StaticMemory | Callable[[], StaticMemory],
    granularity: str = "block",
    max_levels: int = 2,
    grads_accumulate: bool = False,
    checkpoint: str | None = None,
) -> ResumedPlan | None:
    """What of a loaded callback state this run may use at the batch of `shape` (`static`: this run's
    static memory, or how to get it); None to profile and plan as if nothing was saved."""
    if isinstance(loaded, Mapping) and (not loaded or loaded.get("plan") is None):
        return None  # nothing was planned before the checkpoint
    if loaded is None:
        return None
    where = f"checkpoint {checkpoint}" if checkpoint else "the callback state given to load_state_dict"
    if not isinstance(loaded, Mapping):
        return _refuse(where, [f"the callback state is {type(loaded).__name__}, not a mapping"], strict, True)
    found = [p for key, tp in _STATE_TYPES.items() for p in value_problems(tp, loaded.get(key), key)]
    if found:
        return _refuse(where, found, strict, True)
    try:
        stored = _rebuilt(loaded)
    except Exception as err:  # noqa: BLE001 - any state that cannot be read back is planned again
        return _refuse(where, [f"it cannot be read back ({type(err).__name__}: {err})"], strict, True)
    changed = _changes(loaded, stored.plan, signature, target_batch_size, budget_bytes, policy, granularity,
                       max_levels)
    if changed:
        return _refuse(where, changed, strict, False)
    invalid, checkable = _inconsistencies(loaded, stored, signature)
    same = stored.shape is not None and _same_shape(stored.shape, shape, target_batch_size)
    if checkable and same:  # the plan would run here: its peak by the memory model, with this run's memory
        memory = static() if callable(static) else static
        invalid += _memory_problems(stored.plan, stored.cost, memory, budget_bytes, grads_accumulate)
    if invalid:
        return _refuse(where, invalid, strict, True)
    if not same:
        kept = "" if stored.profile is None else f" (its profile, made at ({stored.profile_shape.describe()}), stays)"
        rank_zero_info(
            f"lightning-ckpt: the plan in {where} was made for batch shape ({stored.shape.describe()}); this batch has "
            f"shape ({shape.describe()}), so it is profiled and planned as any new shape{kept}."
        )
        return dataclasses.replace(stored, plan=None, cost=None)
    return stored


def _rebuilt(loaded: Mapping[str, Any]) -> ResumedPlan:
    def read(key: str, kind: Any) -> Any:
        return None if loaded.get(key) is None else kind.from_dict(loaded[key])

    return ResumedPlan(
        Plan.from_dict(loaded["plan"]), read("profile", Profile), read("cost", StepCost),
        read("shape", BatchShape), read("profile_shape", BatchShape),
    )


def _changes(
    loaded: Mapping[str, Any], plan: Plan, signature: list[list[Any]], target_batch_size: int | str,
    budget_bytes: int | None, policy: str, granularity: str, max_levels: int,
) -> list[str]:
    """How this run's settings differ from those the plan was made under."""
    problems = []
    if loaded.get("signature") != signature:
        stored = loaded.get("signature")
        problems.append(
            f"the blocks changed (checkpoint: {len(stored) if isinstance(stored, list) else 0} blocks, "
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
    return problems


def _inconsistencies(
    loaded: Mapping[str, Any], stored: ResumedPlan, signature: list[list[Any]]
) -> tuple[list[str], bool]:
    """What in the state contradicts itself or the chain (the blocks, their names and count), and whether
    the memory model can evaluate the plan (its segments apply to the chain and its cost is there)."""
    plan, cost, profile = stored.plan, stored.cost, stored.profile
    names = [str(s[0]) for s in signature]
    problems = []
    if cost is None:
        problems.append("it holds no step cost to check the plan against")
    if stored.shape is None:
        problems.append("it does not say which batch shape the plan was made for (saved by an earlier version)")
    if profile is not None and stored.profile_shape is None:
        problems.append("it does not say which batch shape its profile was made at (saved by an earlier version)")
    if [r.name for r in plan.rows] != names or [r.index for r in plan.rows] != list(range(len(names))):
        problems.append(f"the plan's rows are not the chain's {len(names)} blocks in order")
    profiled = [] if profile is None else [*profile.probes, profile.check]
    for what, costs in (("step cost", [cost]), ("profile", profiled)):
        if any(c is not None and [b.name for b in c.blocks] != names for c in costs):
            problems.append(f"the {what} is not over the {len(names)} blocks of the chain")
    if problems:
        return problems, False
    try:
        segments = validate_segments(len(names), plan.segments)
        if segments != list(plan.segments):
            raise ValueError(f"they are not in order: {[list(s) for s in plan.segments]}")
        validate_nested(len(names), segments, plan.inner_segments)
        validate_keeps(cost, segments, plan.keep_ops)
    except ValueError as err:
        return [f"its segments cannot be applied: {err}"], False
    owner = segment_of(len(names), segments)
    if any(r.checkpointed != (owner[i] >= 0) or r.segment != owner[i] for i, r in enumerate(plan.rows)):
        problems.append("the plan's table does not show its segments")
    sizes = {"plan": plan.batch_size, "step cost": cost.batch_size, "shape": stored.shape.batch_size}
    if len(set(sizes.values())) > 1:
        problems.append("the batch sizes disagree (" + ", ".join(f"{k} {v}" for k, v in sizes.items()) + ")")
    if plan.budget_bytes != loaded.get("budget_bytes"):
        problems.append(f"the plan's budget ({plan.budget_bytes}) is not the state's ({loaded.get('budget_bytes')})")
    if plan.static_bytes != cost.static_bytes:
        problems.append(
            f"the plan's static memory ({plan.static_bytes} bytes) is not its step cost's ({cost.static_bytes})"
        )
    return problems, True


def _same_shape(stored: BatchShape, shape: BatchShape, target_batch_size: int | str) -> bool:
    """Whether the plan was made for `shape` (with target 'max', for its samples' shape: the batch size
    is the plan's own)."""
    return sample_key(stored) == sample_key(shape) if target_batch_size == "max" else stored == shape


def _memory_problems(
    plan: Plan, cost: StepCost, static: StaticMemory, budget_bytes: int | None, grads_accumulate: bool
) -> list[str]:
    """The plan's peak by the memory model: for its own cost it must be the stored prediction, and with
    this run's static memory (and gradient accumulation) within the budget."""
    now = dataclasses.replace(
        cost, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes,
        grads_accumulate=grads_accumulate, grads_on_device=static.grads_on_device,
    )
    try:
        own = predict_peak(cost, plan.segments, plan.keep_ops, plan.inner_segments).peak_bytes
        here = predict_peak(now, plan.segments, plan.keep_ops, plan.inner_segments).peak_bytes
    except Exception as err:  # noqa: BLE001 - a state the model cannot evaluate is planned again
        return [f"the memory model cannot evaluate it ({type(err).__name__}: {err})"]
    problems = []
    if own != plan.predicted_peak_bytes:
        problems.append(
            f"its stored predicted peak of {plan.predicted_peak_bytes} bytes is not the memory model's {own} bytes "
            "for its own step cost"
        )
    if budget_bytes is not None and here > budget_bytes:
        problems.append(
            f"with this run's static memory ({format_bytes(static.resident_bytes)}) the memory model predicts "
            f"{format_bytes(here)} for it, over the budget of {format_bytes(budget_bytes)}"
        )
    return problems


def _refuse(where: str, problems: list[str], strict: bool, invalid: bool) -> None:
    """One line naming the checkpoint and what was wrong (a warning when the state itself does not hold,
    else information); with `strict`, a ValueError with the same text."""
    msg = f"lightning-ckpt: the plan in {where} does not match this run: {summary(problems)}."
    if strict:
        raise ValueError(msg + " strict_resume=True, so stopping; set strict_resume=False to plan again.")
    (rank_zero_warn if invalid else rank_zero_info)(msg + " Planning again.")
    return None
