"""Rank-0 planning with a broadcast outcome, on simulated ranks (a fake broadcast, no processes)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from lightning_ckpt.engine.rank_zero import (
    ERROR_TYPES,
    PlanningOutcome,
    plan_on_rank_zero,
)
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan

INFEASIBLE = f"{InfeasibleBudgetError.__module__}.InfeasibleBudgetError"  # its name as it crosses ranks


def _plan(policy: str):
    blocks = tuple(BlockCost(f"b{i}", saved_bytes=100, input_bytes=5, output_bytes=5, fwd_flops=10) for i in range(4))
    return make_plan(StepCost(blocks=blocks, batch_size=2, static_bytes=1000), policy)


class Ranks:
    """Runs `plan_on_rank_zero` as rank 0, then as the other ranks, with what rank 0 broadcast."""

    def __init__(self) -> None:
        self.sent: list[PlanningOutcome] = []

    def rank0(self, plan_fn):
        def broadcast(outcome):
            pickle.loads(pickle.dumps(outcome))  # it must survive the pickling a real broadcast does
            self.sent.append(outcome)
            return outcome

        return plan_on_rank_zero(plan_fn, broadcast, rank=0)

    def other(self, plan_fn, rank: int = 1):
        def broadcast(outcome):
            self.sent.append(outcome)
            return self.sent[0]

        return plan_on_rank_zero(plan_fn, broadcast, rank=rank)


def _raises(err: Exception):
    def plan_fn():
        raise err

    return plan_fn


def test_every_rank_gets_rank_zeros_plan():
    ranks = Ranks()
    mine = ranks.rank0(lambda: _plan("full"))
    theirs = ranks.other(lambda: _plan("none"))  # what rank 1 would plan alone does not count
    assert mine == theirs and mine.policy == "full"
    assert mine == _plan("full")
    assert ranks.other(lambda: None, rank=2) == mine  # ranks that only profile return no plan


MESSAGES = [
    "target_batch_size=8 with policy='optimal' needs 31.2 GiB, over the memory_budget of 24.0 GiB: lower it",
    "a: b: c",
    ": starts with the separator",
    "",
    "two\nlines: and a colon",
]


@pytest.mark.parametrize("message", MESSAGES)
@pytest.mark.parametrize("kind", [InfeasibleBudgetError, ValueError, RuntimeError, TypeError, ImportError])
def test_error_type_and_message_survive_the_broadcast_exactly(kind, message):
    ranks = Ranks()
    original = kind(message)
    with pytest.raises(kind) as on_zero:
        ranks.rank0(_raises(original))
    assert on_zero.value is original  # rank 0 raises its own exception, traceback included
    with pytest.raises(kind) as on_one:
        ranks.other(lambda: _plan("full"))
    assert type(on_one.value) is kind and str(on_one.value) == message
    sent = ranks.sent[0]
    assert sent.plan is None and sent.error_message == message


def test_every_registered_type_is_rebuilt_as_itself():
    for name, kind in ERROR_TYPES.items():
        rebuilt = PlanningOutcome(error_type=name, error_message="x: y").error()
        assert type(rebuilt) is kind and str(rebuilt) == "x: y", name
    assert "ValueError" in ERROR_TYPES and INFEASIBLE in ERROR_TYPES


class _PluginError(Exception):
    """An exception class the registry does not know."""


class _NarrowValueError(ValueError):
    """A subclass of a known class is still not in the registry: its own type cannot be rebuilt."""


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (_PluginError("it broke: badly"), f"{__name__}._PluginError: it broke: badly"),
        (_NarrowValueError("too narrow"), f"{__name__}._NarrowValueError: too narrow"),
        (KeyError("blocks"), "KeyError: 'blocks'"),
    ],
)
def test_unknown_type_becomes_runtime_error_naming_it(err, expected):
    ranks = Ranks()
    with pytest.raises(type(err)) as on_zero:
        ranks.rank0(_raises(err))
    assert on_zero.value is err
    with pytest.raises(RuntimeError) as on_one:
        ranks.other(lambda: None)
    assert type(on_one.value) is RuntimeError and str(on_one.value) == expected


def test_rank_failing_alone_warns_and_applies_rank_zeros_plan():
    ranks = Ranks()
    plan = ranks.rank0(lambda: _plan("full"))
    with pytest.warns(UserWarning, match=r"rank 3 failed to profile \(out of memory: here\); it applies rank 0's plan"):
        theirs = ranks.other(_raises(RuntimeError("out of memory: here")), rank=3)
    assert theirs == plan


def test_rank_zero_failing_fails_every_rank_even_those_that_planned():
    ranks = Ranks()
    with pytest.raises(InfeasibleBudgetError):
        ranks.rank0(_raises(InfeasibleBudgetError("no plan fits")))
    with pytest.raises(InfeasibleBudgetError, match="^no plan fits$"):
        ranks.other(lambda: _plan("full"))


def test_every_rank_reaches_the_broadcast_once():
    ranks = Ranks()
    with pytest.raises(ValueError):
        ranks.rank0(_raises(ValueError("bad")))
    with pytest.raises(ValueError):
        ranks.other(_raises(TypeError("also bad")))
    assert len(ranks.sent) == 2


def test_outcome_is_frozen_plain_data():
    outcome = PlanningOutcome.of_error(InfeasibleBudgetError("x"))
    assert outcome == PlanningOutcome(None, INFEASIBLE, "x")
    assert outcome.failed and not PlanningOutcome(plan={}).failed
    with pytest.raises(dataclasses.FrozenInstanceError):
        outcome.error_message = "y"  # type: ignore[misc]
