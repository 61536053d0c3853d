"""Plug `exact_knapsack` into torch.compile's activation-memory-budget partitioner.

``torch._functorch.config.activation_memory_budget_solver`` accepts an instance of
``torch._inductor.custom_graph_pass.CustomKnapsackSolver``; `exact_knapsack_solver()`
returns one backed by `exact_knapsack`. ``torch._inductor`` takes about a second to
import, so the subclass is built on first use rather than at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["ExactKnapsackSolver", "exact_knapsack_solver"]

RuntimeEstimator = Callable[[torch.fx.Node], float]

_SOURCES = tuple(
    str(Path(__file__).with_name(name))
    for name in (
        "compile_adapter.py",
        "knapsack.py",
        "_common.py",
        "_intmodel.py",
        "_core.py",
        "_exact.py",
    )
)


def exact_knapsack_solver(runtime_estimator: RuntimeEstimator | None = None) -> Any:
    """A ``CustomKnapsackSolver`` that picks the saved activations with `exact_knapsack`.

    PyTorch hands a custom solver the memory of each candidate but not its runtime,
    so runtimes come from `runtime_estimator(node)`, by default the partitioner's own
    ``estimate_runtime`` (which follows ``activation_memory_budget_runtime_estimator``:
    FLOPs unless configured otherwise). Use as::

        with torch._functorch.config.patch(
            activation_memory_budget=0.5,
            activation_memory_budget_solver=exact_knapsack_solver(),
        ):
            compiled = torch.compile(model)
    """
    return _solver_class()(runtime_estimator)


@functools.cache
def _solver_class() -> type:
    from torch._inductor.custom_graph_pass import (
        CustomKnapsackSolver,
        get_hash_for_files,
    )

    from lightning_ckpt.solvers.knapsack import exact_knapsack

    class ExactKnapsackSolver(CustomKnapsackSolver):
        """`exact_knapsack` behind torch's custom knapsack solver interface."""

        def __init__(self, runtime_estimator: RuntimeEstimator | None = None) -> None:
            self.runtime_estimator = runtime_estimator
            self.calls = 0  # how many knapsacks this instance has solved

        def __call__(
            self,
            memory: list[float],
            joint_graph: torch.fx.Graph,
            max_memory: float,
            node_info: Any,
            all_recomputable_banned_nodes: list[torch.fx.Node],
        ) -> tuple[list[int], list[int]]:
            runtimes = [float(self._runtime(node)) for node in all_recomputable_banned_nodes]
            _, saved, recomputed = exact_knapsack(memory, runtimes, max_memory)
            self.calls += 1
            return saved, recomputed

        def _runtime(self, node: torch.fx.Node) -> float:
            if self.runtime_estimator is not None:
                return self.runtime_estimator(node)
            from torch._functorch.partitioners import estimate_runtime

            return estimate_runtime(node)

        def uuid(self) -> Any:
            """Hash of the solver sources; None (no caching) for an estimator without uuid."""
            estimator = self.runtime_estimator
            if estimator is None:
                extra = "partitioner-estimate_runtime"
            elif callable(getattr(estimator, "uuid", None)):
                extra = repr(estimator.uuid())
            else:
                return None
            return get_hash_for_files(_SOURCES, extra)

    ExactKnapsackSolver.__module__ = __name__
    ExactKnapsackSolver.__qualname__ = "ExactKnapsackSolver"
    return ExactKnapsackSolver


def __getattr__(name: str) -> Any:
    if name == "ExactKnapsackSolver":
        return _solver_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
