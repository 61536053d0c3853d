"""The per-shape plan cache stays bounded: the least recently used shape goes first, and a shape met again
after it was dropped is costed and planned again from the profiles, with no profiling."""

from __future__ import annotations

import math

import pytest
import torch
from test_shape_plans import _Recorder

from lightning_ckpt.engine.plan_cache import MAX_PLANS, PlanCache
from lightning_ckpt.engine.shape_plans import ShapePlans
from lightning_ckpt.profiling.structure.shapes import shape_of


def test_the_least_recently_used_entry_goes_first():
    cache = PlanCache(3)
    for k in "abc":
        cache[k] = k.upper()
    assert cache.used("a") == "A"  # now the most recent
    cache["d"] = "D"
    assert list(cache) == ["c", "a", "d"] and cache.evicted == 1
    assert cache.used("b") is None
    with pytest.raises(ValueError, match="an int >= 1; got 0"):
        PlanCache(0)


def _image(h: int, w: int) -> tuple:
    return torch.zeros(2, 3, h, w), torch.zeros(2, dtype=torch.long)


class _Images(_Recorder):
    """Bytes in proportion to the pixels; each plan remembers the shape it was made for."""

    def profile(self, batch, own):
        from test_shape_grid import _grid

        h, w = batch[0].shape[2:]
        self.profiled.append(((h, w), own))
        return _grid([(h, w)]).points[0][1]

    made: dict = {}  # id of each plan made (all kept alive in `kept`) -> the shape it was made for
    kept: list = []

    def plan(self, cost_of, shape):
        plan = super().plan(cost_of, shape)
        self.made[id(plan)] = shape
        self.kept.append(plan)
        return plan


def test_two_thousand_distinct_shapes_keep_the_cache_bounded_and_every_cached_plan_its_own_shape():
    rec = _Images()
    plans = ShapePlans(rec.profile, rec.plan)
    sizes = [(8 + h, 8 + w) for h in range(50) for w in range(40)]  # 2,000 distinct images
    for h, w in sizes:
        decision = plans.plan_for(_image(h, w))
        assert rec.made[id(decision.plan)] == decision.shape == shape_of(_image(h, w))
    assert len(plans.plans) == MAX_PLANS and plans.plans.evicted == len(sizes) - MAX_PLANS
    for decision in plans.plans.values():  # what stays cached is each shape's own plan
        assert rec.made[id(decision.plan)] == decision.shape
    runs = plans.profile_runs
    # sizes that keep growing from 8 x 8 to 57 x 47: a profile each time one is more than 1.25x past the largest
    assert runs <= 2 * math.ceil(math.log(57 / 8) / math.log(1.25)) + 3, f"{runs} profiles for 2,000 sizes"
    again = plans.plan_for(_image(*sizes[0]))  # dropped long ago: planned again, not profiled
    assert again.new and plans.profile_runs == runs and rec.made[id(again.plan)] == shape_of(_image(*sizes[0]))
    assert not plans.plan_for(_image(*sizes[-1])).new
