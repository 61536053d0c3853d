"""The per-shape plan cache, bounded: the least recently used shape's plan goes first.

A run with many distinct shapes (multi-scale images, lengths that keep growing) would otherwise keep a plan
per shape forever. `MAX_PLANS` shapes stay cached, far more than a pipeline switches between; a shape evicted
and met again is costed again from the profiles (milliseconds, no profiling) and planned again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_PLANS = 256


class PlanCache(OrderedDict):
    """An ordered map from a shape's key to its decision, oldest use first, at most `max_plans` entries."""

    def __init__(self, max_plans: int = MAX_PLANS) -> None:
        if not isinstance(max_plans, int) or isinstance(max_plans, bool) or max_plans < 1:
            raise ValueError(f"max_plans is the number of shapes whose plans are kept, an int >= 1; got {max_plans!r}.")
        super().__init__()
        self.max_plans = max_plans
        self.evicted = 0  # plans dropped to stay within max_plans

    def __setitem__(self, key: Any, decision: Any) -> None:
        super().__setitem__(key, decision)
        self.move_to_end(key)
        while len(self) > self.max_plans:
            self.popitem(last=False)
            self.evicted += 1

    def used(self, key: Any) -> Any:
        """The decision at `key` (None when not cached), marked as the most recently used."""
        decision = self.get(key)
        if decision is not None:
            self.move_to_end(key)
        return decision
