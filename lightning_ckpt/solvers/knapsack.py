"""0/1 knapsack solvers for save-versus-recompute, with PyTorch's signature.

Each solver is ``f(memory, runtimes, max_memory) -> (runtime saved, saved
indices, recomputed indices)`` like those in
``torch/_functorch/_activation_checkpointing/knapsack.py``: maximise the runtime of
the saved items subject to their memory fitting ``max_memory``.

What fits, for every solver here (`_common.fits`): the exact real sum of the float64
memory values is at most ``max_memory + max_memory * 2**-40`` (about 1e-12 relative
more). The allowance is representation noise, not room: sizes that are whole multiples
of a decimal unit (k x 1e-4) meet a budget on that grid, however their float sums round.
Whole byte counts against budgets below 2**39 bytes are decided exactly.
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
    budget_limit,
    fits,
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
    when they still fit (as `fits` decides: the exact real sum of the float memory
    values against the budget's limit), so the selection always fits. Zero-memory
    items with positive runtime are saved, zero-runtime items are not. Not optimal in
    general.
    """
    w, v, cap = as_problem(memory, runtimes, max_memory, "greedy_knapsack")
    always, _, decide = split_trivial(w, v, cap)
    with np.errstate(over="ignore"):  # a huge runtime on a tiny size: ratio inf, first
        ratio = v[decide] / w[decide]
    order = decide[np.argsort(-ratio, kind="stable")]
    limit = budget_limit(cap)
    taken: list[int] = []
    taken_w: list[float] = []
    total = 0.0
    for i, wi in zip(order.tolist(), w[order].tolist()):
        trial = total + wi
        err = (len(taken_w) + 2) * 2.0**-52 * trial  # bound on the float sum's error
        if trial <= limit - err or (trial <= limit + err and fits_exactly(taken_w + [wi], limit)):
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
    The selection is optimal and within budget *on those integers*; on the real memory
    values rounding can put it over ``max_memory`` by at most (number saved + 1) /
    (2 * scale), as with ``dp_knapsack``. With ``feasible=True`` (the default) an answer
    that does not fit (module docstring) is never returned: the DP is run again with
    memory rounded up and the budget down, each forgiving the few-ulp noise of the
    product with `scale`, and that answer always fits. Only then can the answer differ
    from ``dp_knapsack``'s, whose selection does not fit.

    Grid-aligned inputs are solved exactly: when every memory value and ``max_memory``
    are whole multiples of ``1 / scale`` up to a relative 2**-50 (a value made by a few
    float operations, such as ``k * 1e-4``), with the budget under 2**39 quanta, a
    selection fits iff it fits on the grid, so the rounded answer fits and no selection
    that fits is worth more (for ``scale = 10**j``, the runtime `exact_knapsack` finds,
    up to rounding of runtime sums). Otherwise use `exact_knapsack` for the optimum on
    the real values.

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
    with np.errstate(over="ignore", invalid="ignore"):
        ws = w * scale
        qf = np.rint(ws)  # same double product, same half-to-even rounding as dp_knapsack
    saved = _rounded_select(qf, v, round(cap * scale))  # the budget rounding of dp_knapsack
    if feasible and not fits(w[saved].tolist(), cap):
        # [constraint] memory rounded up and budget down, each by at most _PRODUCT_NOISE
        # relative to the product (3.0000000000000004 quanta stay 3): the real sum of the
        # answer is within cap * (1 + 2 * _PRODUCT_NOISE + 5 * 2**-53) < budget_limit(cap).
        cs = cap * scale
        with np.errstate(over="ignore", invalid="ignore"):  # inf - inf: nan, never selected
            snapped = np.ceil(ws - _PRODUCT_NOISE * ws)
        saved = _rounded_select(snapped, v, math.floor(cs + _PRODUCT_NOISE * cs))
        if not fits(w[saved].tolist(), cap):
            raise AssertionError(
                "dp_knapsack_hirschberg: internal error, the conservative answer does not "
                "fit max_memory; please report this input"
            )
    return make_result(v, saved, n)


# Relative error of `memory * scale` and `max_memory * scale` forgiven before rounding
# (8 units in the last place); the bound above needs it far below 2**-41.
_PRODUCT_NOISE = 8 * 2.0**-52


def _rounded_select(qf: np.ndarray, v: np.ndarray, qcap: int) -> np.ndarray:
    """Indices saved on integer weights `qf` (floats, nan: never) within `qcap`.

    Weight-0 items with positive runtime are saved; the rest are left to the DP.
    """
    free = np.flatnonzero((qf == 0) & (v > 0))
    decide = np.flatnonzero((qf > 0) & (qf <= qcap) & (v > 0))
    if decide.size == 0:
        return free
    picked = hirschberg_select(qf[decide].astype(np.int64), v[decide], qcap)
    return np.concatenate((free, decide[picked]))


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
    if decide.size == 0 or fits(w[decide].tolist(), cap):
        value, saved, recomputed = make_result(v, np.concatenate((always, decide)), n)
        return KnapsackSolution(value, saved, recomputed, 0.0, tolerance, 0, False)
    model = _exact.fit_model(w[decide], cap, budget_limit(cap))  # [constraint] fits
    margin = 2.0**-50 * math.fsum(v[decide].tolist())
    mask, states, slack = _exact.solve_int(model, v[decide], margin, state_budget)
    value, saved, recomputed = make_result(v, np.concatenate((always, decide[mask])), n)
    if not fits(w[saved].tolist(), cap):
        raise AssertionError(
            "exact_knapsack: internal error, the selection does not fit max_memory; "
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

    1. Feasible: S fits (module docstring): the real sum of ``memory`` over S (float64
       inputs added without rounding) is <= L = ``max_memory + max_memory * 2**-40``
       (in float64: `_common.budget_limit`). Checked on every call.
    2. Optimal: v(S) >= v(T) - tau for every selection T whose real memory sum is
       <= L - |T| * delta, where tau = (n + 4) * 2**-50 * sum_v covers
       floating-point rounding of runtime sums (about 1e-13 relative at n = 100),
       and delta is the capacity slack:
       - delta = 0 when all memory values and max_memory are integer multiples of
         one power of two with sums below 2**61 (byte counts, integers, binary
         fractions), and when all memory values are whole multiples of one decimal
         unit 10**-j (j <= 15) up to a relative 2**-48 (k * 1e-4, bytes / 1e9) and L
         is not within that noise of a whole unit: then what fits is decided exactly
         and S is optimal;
       - otherwise delta = max_memory * 2**-40 (memory is rounded up to 2**40 steps
         of the budget: 1e-12 of the budget per item; fewer steps beyond two
         million items, so that sums stay exact in int64);
       - if the search exceeds its effort budget (1e7 DP states, about a second),
         the undecided core is re-solved with memory rounded up to a coarser grid
         (2**24, then 2**16, then 2**10 steps of the budget), and delta grows by
         that grid's step. `solve_knapsack` reports delta, tau and whether this
         happened.

    Zero-memory items with positive runtime are saved, zero-runtime items are not,
    items that do not fit alone are not. Returns ``(runtime of saved items,
    saved indices, recomputed indices)``, indices ascending, the runtime equal to
    ``math.fsum`` over the saved items.
    """
    return solve_knapsack(memory, runtimes, max_memory).as_tuple()
