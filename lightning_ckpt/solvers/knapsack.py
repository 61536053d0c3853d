"""0/1 knapsack solvers for save-versus-recompute, with PyTorch's signature.

Each solver is ``f(memory, runtimes, max_memory) -> (runtime saved, saved
indices, recomputed indices)`` like those in
``torch/_functorch/_activation_checkpointing/knapsack.py``: maximise the runtime of
the saved items subject to their memory summing to at most ``max_memory``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_ckpt.solvers import _exact
from lightning_ckpt.solvers._common import (
    Result,
    as_problem,
    fits_exactly,
    make_result,
    split_trivial,
)
from lightning_ckpt.solvers._hirschberg import hirschberg_select

__all__ = [
    "KnapsackSolution",
    "dp_knapsack_hirschberg",
    "exact_knapsack",
    "greedy_knapsack",
    "solve_knapsack",
]

# Fixed-point scale of PyTorch's dp_knapsack: memory is counted in steps of 1e-4.
TORCH_DP_SCALE = 10_000


def greedy_knapsack(
    memory: Sequence[float], runtimes: Sequence[float], max_memory: float
) -> Result:
    """Greedy by runtime per unit of memory (Dantzig's order), for comparison only.

    Items are visited by decreasing runtime/memory ratio (ties by index) and saved
    when they still fit, the fit being decided on the exact real sum of the float
    memory values, so the selection is never over budget. Zero-memory items with
    positive runtime are saved, zero-runtime items are not. Not optimal in general.
    """
    w, v, cap = as_problem(memory, runtimes, max_memory, "greedy_knapsack")
    always, _, decide = split_trivial(w, v, cap)
    with np.errstate(over="ignore"):  # a huge runtime on a tiny size: ratio inf, first
        ratio = v[decide] / w[decide]
    order = decide[np.argsort(-ratio, kind="stable")]
    taken: list[int] = []
    taken_w: list[float] = []
    total = 0.0
    for i, wi in zip(order.tolist(), w[order].tolist()):
        trial = total + wi
        err = (len(taken_w) + 2) * 2.0**-52 * trial  # bound on the float sum's error
        if trial <= cap - err or (trial <= cap + err and fits_exactly(taken_w + [wi], cap)):
            taken.append(i)
            taken_w.append(wi)
            total = trial
    return make_result(v, np.concatenate((always, np.array(taken, dtype=np.int64))), len(w))


def dp_knapsack_hirschberg(
    memory: Sequence[float],
    runtimes: Sequence[float],
    max_memory: float,
    *,
    scale: int = TORCH_DP_SCALE,
    feasible: bool = True,
) -> Result:
    """The paper's sliding-window + Hirschberg DP, on PyTorch's quantisation.

    Quantisation is that of ``torch...knapsack.dp_knapsack``: each memory value
    becomes ``round(memory[i] * scale)`` and the budget ``round(max_memory * scale)``
    (round half to even, ``scale`` = 10,000), so the optimum equals ``dp_knapsack``'s
    on the same input (up to that solver's float32 sums of runtimes; ours are float64).
    The selection is optimal and within budget *on those
    integers* (float64 runtimes); on the real memory values rounding can put it over
    ``max_memory`` by at most (number saved + 1) / (2 * scale), as with
    ``dp_knapsack``. With ``feasible=True`` (the default) such a selection is never
    returned: the DP is run again on a conservative quantisation (memory rounded up,
    budget down), whose optimum is within budget on the real values. Only then can
    the answer differ from ``dp_knapsack``'s, whose selection is over the budget.
    Use `exact_knapsack` for the optimum on the real values.

    Items quantised to 0 with positive runtime are saved, zero-runtime items are
    not. Memory is O(W) for W = the quantised budget (two float64 rows of at most
    W + 1 cells), time O(nW): rows only span the capacities each half can reach and
    segments of at most 8 items are solved by enumeration.
    """
    w, v, cap = as_problem(memory, runtimes, max_memory, "dp_knapsack_hirschberg")
    n = len(w)
    if n == 0:
        return 0.0, [], []
    if math.isinf(cap):
        return make_result(v, np.flatnonzero(v > 0), n)
    qcap = round(cap * scale)  # the budget rounding of dp_knapsack
    with np.errstate(over="ignore", invalid="ignore"):
        qf = np.rint(w * scale)  # same double product, same half-to-even rounding
    free = (qf == 0) & (v > 0)
    decide = np.flatnonzero((qf > 0) & (qf <= qcap) & (v > 0))
    q = qf[decide].astype(np.int64)
    picked = hirschberg_select(q, v[decide], qcap) if decide.size else np.zeros(0, dtype=np.int64)
    saved = np.concatenate((np.flatnonzero(free), decide[picked]))
    if feasible and not fits_exactly(w[saved].tolist(), cap):
        # [constraint] ceil(w*s) >= w*s and floor(cap*s) <= cap*s: any selection within the
        # conservative integer budget is within the real budget.
        # First with the products' representation noise forgiven (a weight of 3 quanta
        # that the product makes 3.0000000000000004 stays 3, not 4): at the rounded budget,
        # then a quantum or two below it when the real sum of that answer is over the
        # budget (grid-aligned weights whose float sum lands one ulp above); each kept only
        # if its real sum fits; and strictly rounded up, which always fits. The best that fits wins.
        with np.errstate(over="ignore", invalid="ignore"):
            ws = w * scale
            snapped = np.ceil(ws - _PRODUCT_NOISE * np.abs(ws))
            strict = np.ceil(ws)
        cs = cap * scale
        top = math.floor(cs + _PRODUCT_NOISE * abs(cs))
        tries = [(snapped, top - k) for k in range(_BELOW_TRIES + 1)] + [(strict, math.floor(cs))]
        best, best_value = None, -math.inf
        for qc, ccap in tries:
            decide = np.flatnonzero((qc <= ccap) & (v > 0))
            q = qc[decide].astype(np.int64)
            picked = hirschberg_select(q, v[decide], ccap) if decide.size else np.zeros(0, dtype=np.int64)
            pick = decide[picked]
            value = math.fsum(v[pick].tolist())
            if value > best_value and fits_exactly(w[pick].tolist(), cap):
                best, best_value = pick, value
        saved = best
    return make_result(v, saved, n)


# Relative error of `memory * scale` and `max_memory * scale` forgiven before rounding up:
# a few units in the last place of a float64 product.
_PRODUCT_NOISE = 8 * 2.0**-52
_BELOW_TRIES = 2  # budgets one and two quanta below the rounded one


@dataclass(frozen=True)
class KnapsackSolution:
    """`exact_knapsack`'s answer with its optimality certificate.

    value, saved, recomputed: as returned by `exact_knapsack`.
    grid: per-item capacity slack delta of the guarantee (0.0: exact on real weights).
    value_tolerance: tau of the guarantee (floating-point rounding of runtime sums).
    states: Pareto states the core DP generated (the effort spent).
    coarsened: True when the effort budget ran out and a coarser grid was used.
    """

    value: float
    saved: list[int]
    recomputed: list[int]
    grid: float
    value_tolerance: float
    states: int
    coarsened: bool

    def as_tuple(self) -> Result:
        return self.value, self.saved, self.recomputed


def solve_knapsack(
    memory: Sequence[float],
    runtimes: Sequence[float],
    max_memory: float,
    *,
    state_budget: int = _exact.DEFAULT_STATE_BUDGET,
) -> KnapsackSolution:
    """`exact_knapsack` with its certificate (see there for what is guaranteed)."""
    w, v, cap = as_problem(memory, runtimes, max_memory, "exact_knapsack")
    n = len(w)
    always, _, decide = split_trivial(w, v, cap)
    tolerance = (n + 4) * 2.0**-50 * math.fsum(v[decide].tolist())
    if decide.size == 0 or fits_exactly(w[decide].tolist(), cap):
        value, saved, recomputed = make_result(v, np.concatenate((always, decide)), n)
        return KnapsackSolution(value, saved, recomputed, 0.0, tolerance, 0, False)
    model = _exact.integer_model(w[decide], cap)
    margin = 2.0**-50 * math.fsum(v[decide].tolist())
    mask, states, slack = _exact.solve_int(model, v[decide], margin, state_budget)
    value, saved, recomputed = make_result(v, np.concatenate((always, decide[mask])), n)
    if not fits_exactly(w[saved].tolist(), cap):
        raise AssertionError(
            "exact_knapsack: internal error, the selection exceeds max_memory; "
            "please report this input"
        )
    return KnapsackSolution(value, saved, recomputed, slack, tolerance, states, slack > model.slack)


def exact_knapsack(memory: Sequence[float], runtimes: Sequence[float], max_memory: float) -> Result:
    """Optimal save/recompute split; the default solver.

    Method: exact integer model of the float weights, LP-bound variable fixing
    around the Dantzig break item, then Pisinger's expanding-core DP over Pareto
    (memory, runtime) states with bound pruning (see ``_exact``).

    What "exact" means, for n items, S the returned selection, v(.) the runtime sum,
    sum_v the runtime of all items that can be saved:

    1. Feasible, exactly: the real sum of ``memory`` over S (float64 inputs added
       without rounding) is <= ``max_memory``. Checked on every call.
    2. Optimal: v(S) >= v(T) - tau for every selection T whose real memory sum is
       <= max_memory - |T| * delta, where tau = (n + 4) * 2**-50 * sum_v covers
       floating-point rounding of runtime sums (about 1e-13 relative at n = 100),
       and delta is the capacity slack:
       - delta = 0 when all memory values and max_memory are integer multiples of
         one power of two with sums below 2**61 (byte counts, integers, binary
         fractions): then S is optimal on the real weights;
       - otherwise delta = max_memory * 2**-40 (memory is rounded up to 2**40 steps
         of the budget: 1e-12 of the budget per item; fewer steps beyond two
         million items, so that sums stay exact in int64);
       - if the search exceeds its effort budget (1e7 DP states, about a second),
         the undecided core is re-solved with memory rounded up to a coarser grid
         (2**24, then 2**16, then 2**10 steps of the budget), and delta grows by
         that grid's step. `solve_knapsack` reports delta, tau and whether this
         happened.

    Zero-memory items with positive runtime are saved, zero-runtime items are not,
    items heavier than the budget are not. Returns ``(runtime of saved items,
    saved indices, recomputed indices)``, indices ascending, the runtime equal to
    ``math.fsum`` over the saved items.
    """
    return solve_knapsack(memory, runtimes, max_memory).as_tuple()
