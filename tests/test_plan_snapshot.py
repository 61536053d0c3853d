"""The planner reproduces the stored plans of both examples exactly.

`tests/data/plan_snapshot.json` holds the profiled `StepCost` of the 48-block
encoder (batch 16) and of the CNN (stem + 8 blocks, batch 64) and, for every policy,
both cost metrics and nine budgets between the `full` and `none` peaks, the
segments, predicted peak and peak phase the planner gave when it was written
(`benchmarks/plan_snapshot.py --write`). Re-planning from the stored costs must give
the same plans: the memory model and the planners did not change what they decide.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_ckpt import StepCost

SNAPSHOT = Path(__file__).parent / "data" / "plan_snapshot.json"


@pytest.fixture(scope="module")
def snapshot():
    return json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize("example", ["encoder", "cnn"])
def test_plans_match_the_snapshot(snapshot, example):
    from plan_snapshot import plans_of

    entry = snapshot[example]
    again = plans_of(StepCost.from_dict(entry["cost"]))
    assert len(again) == len(entry["plans"]) == 9 * 2 * 7
    different = [(a, b) for a, b in zip(again, entry["plans"]) if a != b]
    assert not different, f"{len(different)} plans changed; first: now {different[0][0]}, stored {different[0][1]}"


def test_snapshot_exercises_checkpointing(snapshot):
    """The stored plans are not all trivial: both examples have optimal plans of
    several segments, and at least one budget where greedy and optimal differ."""
    for example in ("encoder", "cnn"):
        plans = snapshot[example]["plans"]
        optimal = [p for p in plans if p["policy"] == "optimal" and not p.get("infeasible")]
        assert optimal and all(p["peak"] <= p["budget"] for p in optimal)
        assert any(len(p["segments"]) >= 2 for p in optimal)
    greedy = {(p["fraction"], p["metric"]): p.get("segments") for p in snapshot["cnn"]["plans"] if p["policy"] == "greedy"}
    assert any(p.get("segments") != greedy[(p["fraction"], p["metric"])]
               for p in snapshot["cnn"]["plans"] if p["policy"] == "optimal")
