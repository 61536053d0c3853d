"""A measured step judged against the budget (`engine.measured_steps`, through `CheckpointEngine.measured`):
within it nothing changes; over it the excess over the prediction is held in reserve for the shape, which is
planned again at once from its profile; when no plan fits with that reserve the run goes on with its plan.
Each plan made for a shape waits for a step measured under it (`CheckpointEngine.plan_measured`)."""

from __future__ import annotations

import dataclasses

import pytest
from models import tokens_batch
from test_checkpoint_engine import _engine

from lightning_ckpt.engine.measured_steps import MAX_REPLANS, MeasuredStep
from lightning_ckpt.planning.policies import make_plan
from lightning_ckpt.profiling.structure.shapes import shape_of

BATCH = tokens_batch(8, 12)


@pytest.fixture
def planned():
    """An engine planning `optimal` half way between the `full` and `none` peaks, its plan applied, and `full`'s peak."""
    engine, driver = _engine(policy="optimal")
    engine.step(BATCH)
    full, none = (make_plan(engine.cost, p).predicted_peak_bytes for p in ("full", "none"))
    engine.bind(engine.blocks, engine.block_names, dataclasses.replace(engine.settings, budget_bytes=(full + none) // 2))
    engine.step(BATCH)  # planned again from the profile
    assert full < engine.plan.predicted_peak_bytes <= engine.settings.budget_bytes and len(driver.profiled) == 1
    return engine, driver, full


def test_a_step_within_the_budget_changes_nothing(planned):
    engine, driver, _ = planned
    plan, applied = engine.plan, len(driver.applied)
    verdict = engine.measured(engine.settings.budget_bytes, "tracked tensors")
    assert not verdict.over and not verdict.replan and verdict.reserve_bytes == 0
    assert engine.plan is plan and len(driver.applied) == applied and engine.step(BATCH) is None


def test_a_step_over_the_budget_is_planned_again_at_once_with_the_excess_held_in_reserve(planned):
    engine, driver, full = planned
    budget, before = engine.settings.budget_bytes, engine.plan
    unseen = budget - before.predicted_peak_bytes + (before.predicted_peak_bytes - full) // 2
    verdict = engine.measured(before.predicted_peak_bytes + unseen, "tracked tensors")
    assert verdict.over and verdict.replan and verdict.reserve_bytes == verdict.unmodelled_bytes == unseen
    assert verdict.replanned == engine.plan and engine.plan.predicted_peak_bytes + unseen <= budget
    assert engine.plan.predicted_peak_bytes < before.predicted_peak_bytes and engine.plan.budget_bytes == budget - unseen
    assert engine.step(BATCH) is None and len(driver.profiled) == 1  # in place; nothing profiled again
    assert engine.reserves.held(shape_of(BATCH)) == unseen
    message = verdict.message()
    assert message.startswith("lightning-ckpt: OVER THE MEMORY BUDGET at shape (batch 8, tensors [8, 12], [8])")
    assert "(tracked tensors)" in message and "Re-planned that shape with" in message and "measured again" in message
    again = engine.measured(engine.plan.predicted_peak_bytes + unseen, "tracked tensors")  # the next step: within
    assert not again.over and again.reserve_bytes == unseen and engine.plan == verdict.replanned


def test_when_no_plan_fits_with_the_reserve_the_run_goes_on_with_its_plan(planned):
    engine, driver, _ = planned
    before, applied = engine.plan, len(driver.applied)
    verdict = engine.measured(before.predicted_peak_bytes + engine.settings.budget_bytes, "max allocated")
    assert verdict.over and verdict.replanned is None and engine.plan is before and len(driver.applied) == applied
    assert engine.reserves.held(shape_of(BATCH)) == 0 and engine.step(BATCH) is None
    assert "No plan fits with" in verdict.failure and "the run goes on with its plan, over the budget" in verdict.message()
    later = engine.measured(before.predicted_peak_bytes + engine.settings.budget_bytes, "max allocated")
    assert not later.replan and later.failure == verdict.failure  # planned no more


def test_the_largest_rank_s_peak_decides():
    engine, driver = _engine(policy="full")
    engine.step(BATCH)
    driver.all_gather = lambda obj: [obj, engine.settings.budget_bytes + 1]  # rank 1 measured more
    assert engine.measured(1, "tracked tensors").measured_bytes == engine.settings.budget_bytes + 1


def test_over_the_budget_with_nothing_unseen_or_too_often_is_not_planned_again():
    from lightning_ckpt.engine.measured_steps import Reserves

    engine, _ = _engine(policy="full")
    engine.step(BATCH)
    plan, shape, reserves = engine.plan, shape_of(BATCH), Reserves()
    budget = plan.predicted_peak_bytes - 1  # the plan itself is over: a larger reserve cannot help
    verdict = reserves.judge(shape, plan.predicted_peak_bytes, plan, budget, "tracked tensors")
    assert verdict.over and not verdict.replan and "planning again cannot bring it down" in verdict.message()
    for k in range(MAX_REPLANS):
        assert reserves.judge(shape, plan.predicted_peak_bytes + 10 + k, plan, budget, "t").replan
    last = reserves.judge(shape, plan.predicted_peak_bytes + 99, plan, budget, "t")
    assert not last.replan and f"re-planned {MAX_REPLANS} times already" in last.message()
    assert isinstance(last, MeasuredStep) and reserves.held(shape) == 10 + MAX_REPLANS - 1


def test_every_plan_made_for_a_shape_waits_for_a_step_measured_under_it(planned):
    """A shape's first plan, and each plan made for it again (the gradients a step holds changed, a reserve),
    has no step judged until one is measured under it; the same plan met again keeps its judged step."""
    engine, driver, full = planned
    budget = engine.settings.budget_bytes
    assert not engine.plan_measured
    engine.measured(engine.plan.predicted_peak_bytes, "tracked tensors")
    assert engine.plan_measured and engine.step(BATCH) is None and engine.plan_measured
    driver.grads_accumulate = True  # planned again for the gradients of earlier micro-batches
    assert engine.step(BATCH).new and not engine.plan_measured
    engine.measured(engine.plan.predicted_peak_bytes, "tracked tensors")
    assert engine.plan_measured
    before = engine.plan
    unseen = budget - before.predicted_peak_bytes + (before.predicted_peak_bytes - full) // 2
    verdict = engine.measured(before.predicted_peak_bytes + unseen, "tracked tensors")  # over: planned again
    assert verdict.replanned is engine.plan is not before and not engine.plan_measured
    assert not engine.measured(engine.plan.predicted_peak_bytes + unseen, "tracked tensors").over
    assert engine.plan_measured
