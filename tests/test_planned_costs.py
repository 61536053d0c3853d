"""Plans shared by shapes whose steps cost the same, and the costs of planned shapes, bounded."""

from __future__ import annotations

import functools
import gc
import random
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ckpt import auto_checkpoint
from lightning_ckpt.engine.planned_costs import PlannedCosts
from lightning_ckpt.engine.shape_family import _grid_cost, cost_key
from lightning_ckpt.planning import shape_grid
from lightning_ckpt.planning.policies import make_plan
from lightning_ckpt.profiling.structure.shapes import BatchShape, shape_of

from test_shape_family import MultiScaleCNN, _budget, _cnn_loss
from test_shape_grid import CROPS, _grid


def _image_shape(h: int, w: int, n: int = 8) -> BatchShape:
    return BatchShape(n, ((n, 3, h, w), (n,)))


def _cost_of(grid, point, batch_size: int = 8):
    reach = grid.reach(point, batch_size)
    assert reach is not None, point
    return functools.partial(_grid_cost, grid, reach)


def _planner(calls: list):
    def make(cost_of, n=8):
        calls.append(cost_of)
        cost = cost_of(n)
        return make_plan(cost, "none"), cost
    return make


def test_two_shapes_of_one_area_share_the_plan_made_for_the_first():
    grid, calls = _grid(CROPS), []
    planned, make = PlannedCosts(), _planner(calls)
    a, b = _cost_of(grid, (40, 56)), _cost_of(grid, (56, 40))  # neither profiled, 2240 pixels each
    first = planned.plan(a, _image_shape(40, 56), "inputs", lambda: make(a))
    second = planned.plan(b, _image_shape(56, 40), "inputs", lambda: make(b))
    assert second[0] is first[0] and calls == [a] and planned.shared == 1
    assert b(8) == a(8)  # what sharing rests on: the very same step cost


def test_other_inputs_a_profiled_point_or_a_cost_not_from_the_grid_are_planned_alone():
    grid, calls = _grid(CROPS), []
    planned, make = PlannedCosts(), _planner(calls)
    a = _cost_of(grid, (40, 56))
    planned.plan(a, _image_shape(40, 56), "inputs", lambda: make(a))
    planned.plan(a, _image_shape(40, 56), "a smaller budget", lambda: make(a))  # the request is part of the key
    planned.plan(a, _image_shape(40, 56, 4), "inputs", lambda: make(a, 4))  # so is the batch size
    # a term in the height small enough for the area's check: a profiled point's own cost is off the fit
    near = _grid([(64, 48), (48, 64), (32, 24), (16, 40)], lambda p: 48 * p[0] * p[1] + 4 * p[0])
    exact, mirror = _cost_of(near, (32, 24)), _cost_of(near, (24, 32))  # profiled, and not: the same features
    assert near.model(8)[0] == "area" and exact(8) != mirror(8)
    planned.plan(exact, _image_shape(32, 24), "inputs", lambda: make(exact))
    planned.plan(mirror, _image_shape(24, 32), "inputs", lambda: make(mirror))
    own = grid.points[0][1].at  # a profile's own line: one shape
    planned.plan(own, _image_shape(32, 24), "inputs", lambda: make(own))
    planned.plan(own, _image_shape(32, 24), "inputs", lambda: make(own))
    assert len(calls) == 7 and planned.shared == 0
    assert cost_key(exact) != cost_key(mirror) and cost_key(own) is None


def test_a_shared_plan_holds_no_fit_alive_and_a_new_fit_is_never_taken_for_an_old_one():
    planned, calls = PlannedCosts(), []

    def make(cost_of):
        calls.append(1)
        return make_plan(cost_of(8), "none"), cost_of(8)

    grid = _grid(CROPS)
    held, a = weakref.ref(grid), _cost_of(grid, (40, 56))
    planned.plan(a, _image_shape(40, 56), "inputs", lambda: make(a))
    del grid, a
    gc.collect()
    assert held() is None
    other = _grid(CROPS, lambda p: 50 * p[0] * p[1])  # made after the first is gone: its own number, its own plans
    b = _cost_of(other, (40, 56))
    planned.plan(b, _image_shape(40, 56), "inputs", lambda: make(b))
    assert len(calls) == 2 and planned.shared == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([16, 24, 32, 40, 48, 56, 64, 72]).flatmap(lambda h: st.sampled_from([(h, 24), (24, h), (h, 32), (32, h), (h, h)])), min_size=2, max_size=10), st.booleans())
def test_costs_of_equal_keys_are_equal(points, bilinear):
    per_sample = (lambda p: 48 * p[0] * p[1] + 4 * p[0]) if bilinear else (lambda p: 48 * p[0] * p[1])
    grid = _grid([(64, 48), (48, 64), (32, 24), (16, 40), (56, 56)], per_sample)  # one scale on both axes: mirrors
    by_key: dict = {}
    for p in points:
        if grid.reach(p, 8) is None:
            continue
        cost_of = _cost_of(grid, p)
        first = by_key.setdefault(cost_key(cost_of), cost_of(8))
        assert cost_of(8) == first, (p, cost_key(cost_of))


def test_costs_kept_only_for_cached_shapes_and_the_grid_s_points_bounded(monkeypatch):
    planned = PlannedCosts(max_plans=4)
    cached = {(8, 8)}
    for h in range(1, 40):
        planned.keep(_image_shape(h, 8), object(), lambda s: (s.shapes[0][2], s.shapes[0][3]) in cached)
        assert len(planned.by_shape) <= 2 * 4 + 1
    assert _image_shape(39, 8) in planned.by_shape and _image_shape(8, 8) in planned.by_shape
    monkeypatch.setattr(shape_grid, "MAX_COSTS", 16)
    grid = _grid(CROPS)
    for h in range(24, 64):
        _cost_of(grid, (h, 40))(8)
    assert len(grid._point_costs) == 16
    assert grid._point_costs and all(k[1][0] >= 64 - 16 for k in grid._point_costs)  # the latest kept


def _decided(plan) -> dict:
    """The plan without the time estimates, which the rates measured in each run move."""
    out = {k: v for k, v in plan.to_dict().items() if k not in ("rates", "recompute_est_ms")}
    out["rows"] = [{k: v for k, v in row.items() if not k.endswith("_est_ms")} for row in out["rows"]]
    return out


def _steps(batches, budget: int, share: bool, monkeypatch) -> tuple[dict, int]:
    if not share:
        monkeypatch.setattr(PlannedCosts, "plan", lambda self, cost_of, shape, inputs, make: make())
    torch.manual_seed(1)
    model = MultiScaleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    handle = auto_checkpoint(model, budget, example_batch=batches[0], step_fn=lambda b: _cnn_loss(model, b), optimizer=opt,
                             blocks="stages", probe_batch_sizes=(2, 4), cost_metric="flops", verbose=False)
    for batch in batches:
        handle.step(batch)
    plans = {d.shape: (d.source, _decided(d.plan)) for d in handle.engine._shapes.plans.values()}
    shared = handle.engine._costs.shared
    handle.step(next(b for b in reversed(batches) if plans[shape_of(b)][0].startswith("fitted")))
    # a step measured over the budget: its shape planned again with the excess in reserve, not given the plan
    # of an equal cost made with the whole budget
    verdict = handle.engine.measured(budget + 4096)
    assert verdict.replanned is not None and verdict.replanned.budget_bytes == budget - verdict.reserve_bytes < budget
    handle.remove()
    monkeypatch.undo()
    return plans, shared


@pytest.mark.timeout(300)
def test_in_a_multi_scale_run_shared_plans_are_those_each_shape_gets_alone(monkeypatch):
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    sizes = list(range(16, 65, 8))
    pairs = [(rng.choice(sizes), rng.choice(sizes)) for _ in range(30)]
    pairs += [(w, h) for h, w in pairs]  # every shape mirrored: the same pixels
    batches = [(torch.randn(4, 3, h, w, generator=g), torch.randint(0, 3, (4,), generator=g)) for h, w in pairs]
    budget = _budget(MultiScaleCNN, "stages", _cnn_loss, (torch.randn(4, 3, 64, 64), torch.zeros(4, dtype=torch.long)))
    shared, n = _steps(batches, budget, True, monkeypatch)
    alone, none = _steps(batches, budget, False, monkeypatch)
    assert n >= 10 and none == 0, (n, none)
    assert shared == alone
    assert any(p["segments"] for _, p in shared.values()), "the budget should need checkpointing at some sizes"

