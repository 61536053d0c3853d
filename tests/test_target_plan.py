"""The callback's plan for a fixed target batch or for the largest batch, from a hand-made profile."""

from __future__ import annotations

import re

import pytest

from lightning_ckpt.engine.target_plan import (
    PlanRequest,
    cost_at,
    plan_for_max,
    plan_for_target,
)
from lightning_ckpt.planning.capacity import plan_if_fits
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan
from lightning_ckpt.profiling.static_memory import StaticMemory

STATIC = StaticMemory(param_bytes=600, buffer_bytes=0, grad_bytes=0, optimizer_state_bytes=400, optimizer_transient_bytes=0)


def _probe(b: int) -> StepCost:
    """Four blocks whose bytes grow linearly with the batch."""
    blocks = tuple(
        BlockCost(f"b{i}", saved_bytes=100 * b, input_bytes=5 * b, input_saved_bytes=5 * b, output_bytes=5 * b, fwd_flops=10 * b)
        for i in range(4)
    )
    return StepCost(blocks=blocks, batch_size=b)


PROFILE = Profile(probes=(_probe(1), _probe(2)))


def _request(budget: int, max_levels: int = 2, policy: str = "optimal") -> PlanRequest:
    return PlanRequest(budget_bytes=budget, policy=policy, every_k=None, cost_metric="flops", max_levels=max_levels)


def test_cost_at_adds_the_static_memory_to_the_fitted_line():
    cost = cost_at(PROFILE, 8, STATIC)
    assert cost.batch_size == 8 and cost.static_bytes == STATIC.resident_bytes
    assert [b.saved_bytes for b in cost.blocks] == [800] * 4


def test_target_that_fits_gets_the_policy_plan():
    cost = cost_at(PROFILE, 8, STATIC)
    budget = (make_plan(cost, "none").predicted_peak_bytes + make_plan(cost, "full").predicted_peak_bytes) // 2
    plan, got = plan_for_target(PROFILE, STATIC, _request(budget), 8)
    assert got == cost and plan == make_plan(cost, "optimal", budget) and plan.fits


def test_target_that_cannot_fit_names_the_largest_batch_that_does():
    full_8 = make_plan(cost_at(PROFILE, 8, STATIC), "full").predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError, match=r"target_batch_size=8 .* the largest batch that fits with policy='optimal' is (\d+)\. Lower") as info:
        plan_for_target(PROFILE, STATIC, _request(full_8 - 1, max_levels=1), 8)
    largest = int(re.search(r"policy='optimal' is (\d+)", str(info.value)).group(1))
    assert 1 <= largest < 8
    assert plan_if_fits(cost_at(PROFILE, largest, STATIC), full_8 - 1, max_levels=1) is not None
    with pytest.raises(InfeasibleBudgetError, match="not even batch size 1 fits"):
        plan_for_target(PROFILE, STATIC, _request(STATIC.resident_bytes), 8)


def test_the_largest_batch_named_is_the_policy_s_own():
    """With policy='none' the largest batch named is the one that fits without checkpointing."""
    none_8 = make_plan(cost_at(PROFILE, 8, STATIC), "none").predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError, match=r"policy='none' is (\d+)") as info:
        plan_for_target(PROFILE, STATIC, _request(none_8 - 1, policy="none"), 8)
    largest = int(re.search(r"policy='none' is (\d+)", str(info.value)).group(1))
    assert plan_if_fits(cost_at(PROFILE, largest, STATIC), none_8 - 1, "none") is not None
    assert plan_if_fits(cost_at(PROFILE, largest + 1, STATIC), none_8 - 1, "none") is None
    assert plan_if_fits(cost_at(PROFILE, largest + 1, STATIC), none_8 - 1, "optimal") is not None  # optimal fits more


def test_nested_segments_fit_a_target_below_the_full_peak():
    """One byte under `full`'s peak nothing single-level fits; a multi-level plan does."""
    full_8 = make_plan(cost_at(PROFILE, 8, STATIC), "full").predicted_peak_bytes
    plan, _ = plan_for_target(PROFILE, STATIC, _request(full_8 - 1), 8)
    assert plan.fits and plan.inner_segments and plan.batch_size == 8


def test_max_is_the_largest_multiple_that_fits():
    budget = make_plan(cost_at(PROFILE, 40, STATIC), "full").predicted_peak_bytes
    plan, cost = plan_for_max(PROFILE, STATIC, _request(budget), multiple=4)
    assert plan.batch_size % 4 == 0 and plan.fits and cost.batch_size == plan.batch_size >= 40
    assert plan_if_fits(cost_at(PROFILE, plan.batch_size + 4, STATIC), budget) is None
    with pytest.raises(InfeasibleBudgetError, match=r"target_batch_size='max': not even batch size 4 fits"):
        plan_for_max(PROFILE, STATIC, _request(STATIC.resident_bytes), multiple=4)


def test_nothing_fits_says_what_the_static_part_takes():
    static = StaticMemory(
        param_bytes=2 * 2**20, buffer_bytes=0, grad_bytes=2 * 2**20, optimizer_state_bytes=4 * 2**20,
        optimizer_transient_bytes=0,
    )
    with pytest.raises(
        InfeasibleBudgetError,
        match=r"not even batch size 1 fits: the model's state takes 8\.0 MiB of the 1\.0 MiB "
        r"budget \(parameters 2\.0 MiB, gradients 2\.0 MiB, optimizer state 4\.0 MiB\), 7\.0 MiB over it before any "
        r"activation\. Lower target_batch_size or raise memory_budget",
    ):
        plan_for_target(PROFILE, static, _request(2**20), 8)
    with pytest.raises(
        InfeasibleBudgetError,
        match=r"takes 1000 B of the 1\.0 KiB budget \(parameters 600 B, optimizer state 400 B\), which leaves 24 B "
        r"for the activations of one sample",
    ):
        plan_for_target(PROFILE, STATIC, _request(1024), 8)
