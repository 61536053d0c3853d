"""Steps measured against their plan, and the memory held in reserve for what the model does not see.

A front end measures the first steady step under each plan (`CheckpointEngine.measured`): a shape's first
plan, and each plan made for it again (the gradients a step holds changed, a reserve, a resumed plan), until
a step under it is judged (`Reserves.measured`). A step within the budget changes nothing. A step over it
holds the excess over the plan's prediction (memory the memory model does not see: a tensor kept alive
across steps, a cache, a buffer made outside what was profiled) in reserve for that shape, whose next plan
is made for the budget less the reserve:

    reserves = Reserves()
    verdict = reserves.judge(shape, measured_bytes, plan, budget_bytes)   # over: the reserve grows
    budget_bytes - reserves.held(shape)                                   # what the shape is planned for
    judge_step(reserves, shape, plan, peak, budget_bytes, what, replan)   # over: `replan` plans it again now

Plain Python over shapes and plans; nothing here runs a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import InfeasibleBudgetError
from lightning_ckpt.profiling.structure.shapes import BatchShape
from lightning_ckpt.units import format_bytes

if TYPE_CHECKING:
    from lightning_ckpt.engine.target_plan import PlanRequest

MAX_REPLANS = 3  # re-plans of one shape for measured excess; past that the run goes on with a warning


@dataclass(frozen=True)
class MeasuredStep:
    """One measured step judged against the budget.

    `reserve_bytes`: held back from the budget for `shape` from now on (the excess over the prediction
    when over). `replan`: the shape is to be planned again with it. `replanned`: the plan that was
    made (None until then, or when none fits: `failure` says why)."""

    shape: BatchShape
    measured_bytes: int
    predicted_bytes: int
    budget_bytes: int
    reserve_bytes: int = 0
    replan: bool = False
    replanned: Plan | None = None
    failure: str = ""
    what: str = "measured"  # what was measured ("tracked tensors", "max allocated")

    @property
    def over(self) -> bool:
        return self.measured_bytes > self.budget_bytes

    @property
    def unmodelled_bytes(self) -> int:
        """The measured peak minus the prediction: memory of the step the memory model does not see."""
        return self.measured_bytes - self.predicted_bytes

    def message(self) -> str:
        """The warning for a step over the budget: both numbers, the excess, and what was done."""
        fmt = format_bytes
        head = (
            f"lightning-ckpt: OVER THE MEMORY BUDGET at shape ({self.shape.describe()}): the step measured "
            f"{fmt(self.measured_bytes)} ({self.what}), {fmt(self.measured_bytes - self.budget_bytes)} over the "
            f"memory_budget of {fmt(self.budget_bytes)}; the plan predicted {fmt(self.predicted_bytes)}"
        )
        if self.unmodelled_bytes > 0:
            head += (
                f", so {fmt(self.unmodelled_bytes)} of the step is memory the memory model does not see (a tensor "
                "kept alive across steps, a cache, a buffer made outside what was profiled)"
            )
        advice = (
            f"Lower memory_budget by {fmt(max(self.unmodelled_bytes, self.measured_bytes - self.budget_bytes))} to plan "
            "for it from the start, or find what holds that memory."
        )
        if self.replanned is not None:
            plan = self.replanned
            what = f"{len(plan.checkpointed)}/{plan.n_blocks} blocks checkpointed" if plan.segments else "nothing checkpointed"
            return (
                f"{head}. Re-planned that shape with {fmt(self.reserve_bytes)} held in reserve: {what}, predicted "
                f"{fmt(plan.predicted_peak_bytes)} + {fmt(self.reserve_bytes)} within {fmt(self.budget_bytes)}; its "
                f"next step is measured again. {advice}"
            )
        return f"{head}. {self.failure or 'It was not re-planned'}; the run goes on with its plan, over the budget. {advice}"


@dataclass
class Reserves:
    """Bytes held back from the budget per shape (`held`), how often each shape was re-planned, the
    shapes that are planned no more for measured excess, with why, and the plan each shape's last judged
    step ran under (`measured`; a plan made since has no step judged yet)."""

    bytes_held: dict[BatchShape, int] = field(default_factory=dict)
    replans: dict[BatchShape, int] = field(default_factory=dict)
    stopped: dict[BatchShape, str] = field(default_factory=dict)
    measured: dict[BatchShape, Plan] = field(default_factory=dict)

    def was_measured(self, shape: BatchShape | None, plan: Plan | None) -> bool:
        """Whether a step of `shape` under this very `plan` (not an equal one made again) was judged."""
        return shape is not None and plan is not None and self.measured.get(shape) is plan

    def held(self, shape: BatchShape | None) -> int:
        return self.bytes_held.get(shape, 0) if shape is not None else 0

    def judge(self, shape: BatchShape, measured_bytes: int, plan: Plan, budget_bytes: int, what: str) -> MeasuredStep:
        """The verdict on a step at `shape` run under `plan`: over the budget, the reserve becomes the
        excess over the prediction (never less than before) and `replan` says whether planning again can
        help (the reserve grew, and the shape was re-planned fewer than `MAX_REPLANS` times)."""
        held = self.held(shape)
        step = MeasuredStep(shape, measured_bytes, plan.predicted_peak_bytes, budget_bytes, held, what=what)
        if not step.over:
            return step
        reserve = max(held, step.unmodelled_bytes)
        if shape in self.stopped:
            return dataclasses.replace(step, failure=self.stopped[shape])
        if reserve <= held:
            return dataclasses.replace(step, failure=(
                f"The plan itself predicts {format_bytes(plan.predicted_peak_bytes)} with {format_bytes(held)} held "
                "in reserve, so planning again cannot bring it down"
            ))
        if self.replans.get(shape, 0) >= MAX_REPLANS:
            return dataclasses.replace(step, reserve_bytes=held, failure=(
                f"That shape was re-planned {MAX_REPLANS} times already, each time with more in reserve"
            ))
        self.bytes_held[shape] = reserve
        self.replans[shape] = self.replans.get(shape, 0) + 1
        return dataclasses.replace(step, reserve_bytes=reserve, replan=True)

    def request(self, request: PlanRequest, shape: BatchShape) -> PlanRequest:
        """`request` for `shape`: its budget less what is held in reserve for that shape."""
        held = self.held(shape)
        return dataclasses.replace(request, budget_bytes=request.budget_bytes - held) if held else request

    def give_up(self, shape: BatchShape, held: int, why: str) -> None:
        """No plan fits with the larger reserve (`why`): hold what was held before, and plan the shape no more."""
        if held:
            self.bytes_held[shape] = held
        else:
            self.bytes_held.pop(shape, None)
        self.stopped[shape] = why


def judge_step(
    reserves: Reserves, shape: BatchShape, plan: Plan, peak_bytes: int, budget_bytes: int, what: str,
    replan: Callable[[BatchShape], Plan | None],
) -> MeasuredStep:
    """The step at `shape` run under `plan` peaked at `peak_bytes` (the largest rank's): judged against
    `budget_bytes`; over it with more unseen than held, `replan(shape)` plans that shape again now with the
    excess in reserve and applies it (returning the plan, or None when the plan in place was kept). When it
    raises `InfeasibleBudgetError` or `ValueError` (no plan fits with that reserve; it put the old plan back),
    the shape keeps its plan and is planned no more."""
    held = reserves.held(shape)
    verdict = reserves.judge(shape, peak_bytes, plan, budget_bytes, what)
    reserves.measured[shape] = plan  # a plan made again below has its own next step judged
    if not verdict.replan:
        return verdict
    try:
        replanned = replan(shape)
    except (InfeasibleBudgetError, ValueError) as err:  # the measured step ran: the run goes on, told why
        why = f"No plan fits with {format_bytes(verdict.reserve_bytes)} in reserve ({err})"
        reserves.give_up(shape, held, why)
        return dataclasses.replace(verdict, reserve_bytes=held, replan=False, failure=why)
    return dataclasses.replace(verdict, replanned=replanned)
