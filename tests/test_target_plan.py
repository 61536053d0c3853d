"""The callback's plan for a fixed target batch or for the largest batch, from a hand-made profile."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lightning_ckpt.engine.target_plan import (
    PlanRequest,
    check_host_memory,
    cost_at,
    plan_for_max,
    plan_for_target,
)
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.capacity import plan_if_fits
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan
from lightning_ckpt.profiling.memory.static_memory import StaticMemory

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


OFFLOADED = dataclasses.replace(
    STATIC, grads_on_device=False, nvme_bytes=7 * 2**20,
    host_parts=(("fp32 master weights", 3 * 2**20), ("optimizer state", 6 * 2**20)),
)


def test_a_host_budget_too_small_is_refused_naming_both_numbers():
    """What the strategy keeps in host memory is checked before any planning, for a fixed target and for 'max'."""
    request = dataclasses.replace(_request(10**9), host_budget_bytes=8 * 2**20)
    expected = (r"keeps 9\.0 MiB per rank in host memory \(fp32 master weights 3\.0 MiB, optimizer state 6\.0 MiB\), "
                r"over the host budget of 8\.0 MiB: the host cannot hold what is offloaded to it\. Raise host_memory_budget")
    with pytest.raises(InfeasibleBudgetError, match=expected):
        plan_for_target(PROFILE, OFFLOADED, request, 8)
    with pytest.raises(InfeasibleBudgetError, match=expected):
        plan_for_max(PROFILE, OFFLOADED, request, 1)
    check_host_memory(OFFLOADED, dataclasses.replace(request, host_budget_bytes=9 * 2**20))  # exactly enough
    check_host_memory(OFFLOADED, _request(10**9))  # no host budget: nothing checked
    check_host_memory(STATIC, request)  # nothing offloaded


def test_the_plan_carries_the_host_and_nvme_bytes_and_gradients_off_the_device():
    request = dataclasses.replace(_request(10**9), host_budget_bytes=2**30)
    plan, cost = plan_for_target(PROFILE, OFFLOADED, request, 8)
    assert (plan.host_bytes, plan.nvme_bytes) == (9 * 2**20, 7 * 2**20)
    assert not cost.grads_on_device and cost_at(PROFILE, 8, STATIC).grads_on_device
    line = next(ln for ln in str(plan).splitlines() if ln.startswith("predicted peak"))
    assert line.endswith("; offloaded: 9.0 MiB in host memory, 7.0 MiB on NVMe"), line
    assert plan.to_dict()["host_bytes"] == 9 * 2**20 and Plan.from_dict(plan.to_dict()) == plan
    plain, _ = plan_for_target(PROFILE, STATIC, request, 8)
    assert (plain.host_bytes, plain.nvme_bytes) == (0, 0) and "offloaded" not in str(plain)
    best, _ = plan_for_max(PROFILE, OFFLOADED, dataclasses.replace(request, budget_bytes=40_000), 1)
    assert best.host_bytes == 9 * 2**20
