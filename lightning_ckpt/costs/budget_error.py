"""The error for a memory budget that no plan can meet.

Planning raises it when no plan of the kind asked for fits; profiling raises it earlier, before any pass
would hold more than the budget, when not even the passes that measure the step can fit (the `full` plan
holds about what the smallest of them does). It lives here, below both, so that both raise the one type.
"""

from __future__ import annotations

__all__ = ["InfeasibleBudgetError"]


class InfeasibleBudgetError(ValueError):
    """No plan of the requested kind fits the memory budget."""
