"""Plan on rank 0, broadcast the plan or the error, so every rank applies or raises the same.

Every rank runs the planning function (profiling may need collectives), only rank 0's
outcome counts. An error crosses ranks as data: its type as a name from a fixed table
of exception classes, and its message; it is never re-parsed from a formatted string.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import InfeasibleBudgetError


def _qualified_name(kind: type) -> str:
    """`ValueError` for built-in classes, `package.module.Class` for the others."""
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


# The exception classes rebuilt with their own type on the other ranks: each takes its message
# as its only argument, and `str()` of the rebuilt error gives that message back unchanged.
# (KeyError is left out: `str(KeyError(m))` is `repr(m)`.)
ERROR_TYPES: dict[str, type[Exception]] = {
    _qualified_name(kind): kind
    for kind in (
        InfeasibleBudgetError, ValueError, RuntimeError, TypeError, ImportError, ModuleNotFoundError,
        NotImplementedError, AssertionError, IndexError, AttributeError, MemoryError, OSError,
        torch.OutOfMemoryError,
    )
}


@dataclass(frozen=True)
class PlanningOutcome:
    """What rank 0 broadcasts: the plan as a dict, or an error's type name and message."""

    plan: dict[str, Any] | None = None
    error_type: str | None = None
    error_message: str | None = None

    @classmethod
    def of_error(cls, err: BaseException) -> PlanningOutcome:
        return cls(error_type=_qualified_name(type(err)), error_message=str(err))

    @property
    def failed(self) -> bool:
        return self.error_type is not None

    def error(self) -> Exception:
        """The error rebuilt: same type and message; a type outside `ERROR_TYPES` becomes a
        RuntimeError whose message starts with the original type's name."""
        assert self.error_type is not None and self.error_message is not None
        kind = ERROR_TYPES.get(self.error_type)
        if kind is None:
            return RuntimeError(f"{self.error_type}: {self.error_message}")
        return kind(self.error_message)


Broadcast = Callable[[PlanningOutcome], PlanningOutcome]


def plan_on_rank_zero(plan_fn: Callable[[], Plan | None], broadcast: Broadcast, rank: int) -> Plan:
    """Run `plan_fn` here, broadcast rank 0's outcome, return its plan on every rank.

    When rank 0 failed, rank 0 raises its own exception and the other ranks raise it rebuilt
    from the broadcast. A non-zero rank that failed alone warns and takes rank 0's plan.
    Every rank reaches the broadcast, whatever `plan_fn` raised: otherwise the others wait in it forever.
    A broadcast that gives back the very outcome it was given (one process; rank 0 itself) returns the plan
    as it is: the dict was made from it, and `Plan.from_dict` of it gives an equal plan.
    """
    local_error: Exception | None = None
    plan = None
    try:
        plan = plan_fn()
        outcome = PlanningOutcome(plan=None if plan is None else plan.to_dict())
    except Exception as err:  # noqa: BLE001 - it must reach the broadcast, see above
        local_error, outcome = err, PlanningOutcome.of_error(err)
    shared = broadcast(outcome)
    if shared.failed:
        if rank == 0 and local_error is not None:
            raise local_error
        raise shared.error()
    if local_error is not None:
        warnings.warn(f"lightning-ckpt: rank {rank} failed to profile ({local_error}); it applies rank 0's plan.")
    assert shared.plan is not None, "rank 0 returned no plan"
    if shared is outcome and plan is not None:  # nothing crossed a process: no copy to rebuild
        return plan
    return Plan.from_dict(shared.plan)
