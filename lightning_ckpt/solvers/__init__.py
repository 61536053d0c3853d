"""Exact and reference 0/1 knapsack solvers for choosing what to save or recompute.

Plain functions with PyTorch's knapsack signature (``memory, runtimes, max_memory``
-> ``(runtime saved, saved, recomputed)``); `exact_knapsack` is the default. The
torch.compile adapter lives in `lightning_ckpt.solvers.compile_adapter` (imported on
demand: it pulls in ``torch._inductor``).
"""

from lightning_ckpt.solvers.knapsack import (
    KnapsackSolution,
    dp_knapsack_hirschberg,
    exact_knapsack,
    greedy_knapsack,
    solve_knapsack,
)

__all__ = [
    "KnapsackSolution",
    "dp_knapsack_hirschberg",
    "exact_knapsack",
    "greedy_knapsack",
    "solve_knapsack",
]
