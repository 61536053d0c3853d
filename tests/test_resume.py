"""A checkpoint's plan on resume: reused when the run matches, re-planned or refused when not (a
multi-level plan nested deeper than max_levels included)."""

from __future__ import annotations

import pytest
import torch

from lightning_ckpt.frontends.lightning.resume import (
    block_signature,
    callback_state,
    resumed_plan,
)
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.planning.policies import make_plan

BLOCKS = [torch.nn.Linear(4, 4) for _ in range(3)]
NAMES = ["blocks.0", "blocks.1", "blocks.2"]
COST = StepCost(blocks=tuple(BlockCost(n, saved_bytes=100, input_bytes=5) for n in NAMES), batch_size=8)
PLAN = make_plan(COST, "full")


def _state(**changes):
    state = callback_state(PLAN, None, COST, block_signature(NAMES, BLOCKS), 10_000, "full")
    return {**state, **changes}


def _resume(state, target=8, budget=10_000, policy="full", strict=False, blocks=BLOCKS):
    return resumed_plan(state, block_signature(NAMES, blocks), target, budget, policy, strict=strict)


def test_matching_state_gives_back_plan_and_cost():
    resumed = _resume(_state())
    assert resumed.plan == PLAN and resumed.cost == COST and resumed.profile is None
    assert _resume(_state(), target="max").plan == PLAN


@pytest.mark.parametrize("state", [None, {}, {"plan": None}])
def test_nothing_saved_means_plan_again(state):
    assert _resume(state) is None


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"blocks": [torch.nn.Linear(4, 5)] + BLOCKS[1:]}, r"the blocks changed \(checkpoint: 3 blocks, now: 3 blocks"),
        ({"target": 16}, r"the plan is for batch 8, target_batch_size is 16"),
        ({"budget": 20_000}, r"memory_budget or policy changed"),
        ({"policy": "optimal"}, r"memory_budget or policy changed"),
    ],
)
def test_mismatch_replans_with_info_or_raises_when_strict(kwargs, problem, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        assert _resume(_state(), **kwargs) is None
    assert "does not match this run" in caplog.text and "Planning again" in caplog.text
    with pytest.raises(ValueError, match=rf"does not match this run: .*{problem}.* strict_resume=True, so stopping"):
        _resume(_state(), strict=True, **kwargs)


# a plan that rebuilds block 1 inside the recompute of segment (0, 2), and one nested a level deeper
NESTED = make_plan(COST, "manual", segments=[(0, 2)], inner_segments=[(1, 1)])
DEEPER = make_plan(COST, "manual", segments=[(0, 2)], inner_segments=[(0, 1), (0, 0)])


def _resume_optimal(plan, max_levels, strict):
    """`plan` saved by a run with policy optimal, resumed by the same run at `max_levels`."""
    state = callback_state(plan, None, COST, block_signature(NAMES, BLOCKS), 10_000, "optimal")
    return resumed_plan(state, block_signature(NAMES, BLOCKS), 8, 10_000, "optimal", strict=strict, max_levels=max_levels)


@pytest.mark.parametrize(("plan", "levels", "max_levels"), [(NESTED, 2, 1), (DEEPER, 3, 2), (DEEPER, 3, 1)])
def test_plan_nested_deeper_than_max_levels_replans_or_raises_when_strict(plan, levels, max_levels, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        assert _resume_optimal(plan, max_levels, strict=False) is None
    problem = f"the plan nests segments {levels} levels deep, max_levels is {max_levels}"
    assert problem in caplog.text and "Planning again" in caplog.text
    with pytest.raises(ValueError, match=rf"does not match this run: {problem}\. strict_resume=True, so stopping"):
        _resume_optimal(plan, max_levels, strict=True)


@pytest.mark.parametrize(("plan", "max_levels"), [(NESTED, 2), (NESTED, 3), (DEEPER, 3), (PLAN, 1)])
def test_plan_within_max_levels_is_kept_with_its_inner_segments(plan, max_levels):
    resumed = _resume_optimal(plan, max_levels, strict=True)
    assert resumed.plan == plan and resumed.plan.inner_segments == plan.inner_segments
