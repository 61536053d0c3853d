"""The costs of the shapes planned, kept while their plans are cached, and a plan shared by shapes whose
steps cost the same.

A fit over several sizes costs a shape from a few features of its sizes (`GridProfile.cost_key`): under
the model linear in the product of the sizes, 16 x 48 and 48 x 16 cost the very same step, so the plan
made for one is the plan of the other. `PlannedCosts.plan` makes one plan per such cost and per what every
plan reads besides it (the batch size, the request with its budget and any reserve, the static memory),
and keeps each shape's cost only while its plan is cached (`engine.plan_cache`), so a run of many shapes
holds neither costs nor plans without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.engine.plan_cache import MAX_PLANS, PlanCache
from lightning_ckpt.engine.shape_family import CostOf, cost_key
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.profiling.structure.shapes import BatchShape


class PlannedCosts:
    """Each planned shape's cost (`by_shape`) and the plans of equal costs (`plan`), both bounded."""

    def __init__(self, max_plans: int = MAX_PLANS) -> None:
        self.by_shape: dict[BatchShape, StepCost] = {}
        self._shared = PlanCache(max_plans)  # (cost key, batch size, inputs) -> (plan, cost)
        self.shared = 0  # plans taken from a shape of equal cost

    def plan(
        self, cost_of: CostOf, shape: BatchShape, inputs: Hashable, make: Callable[[], tuple[Plan, StepCost]]
    ) -> tuple[Plan, StepCost]:
        """(plan, cost) at `shape` from `cost_of`: `make()`'s, or that of an earlier shape whose cost has the
        same key with the same `inputs` (everything else the plan reads)."""
        key = cost_key(cost_of)
        if key is not None:
            key = (key, shape.batch_size, inputs)
            found = self._shared.used(key)
            if found is not None:
                self.shared += 1
                return found
        plan, cost = make()
        if key is not None:
            self._shared[key] = (plan, cost)
        return plan, cost

    def keep(self, shape: BatchShape, cost: StepCost, cached: Callable[[BatchShape], bool]) -> None:
        """Hold `shape`'s cost; past twice as many as plans are cached, only those of shapes still `cached`."""
        self.by_shape[shape] = cost
        if len(self.by_shape) > 2 * self._shared.max_plans:
            self.by_shape = {s: c for s, c in self.by_shape.items() if s == shape or cached(s)}
