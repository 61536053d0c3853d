"""The plan that checkpoints nothing, recognised as the optimum from the step cost alone.

Most plans of a run keep every block: the budget holds the whole step. `chain_planner._all_kept`
finds that out on the columns of `chain_arrays`; `all_kept_optimum` decides the same with the
scalar element form of `memory_model` (`kept_element`, `end_need`, ...) and the recompute of
`chain_arrays.recompute_columns`, in the same arithmetic, so the exact planner need not build
its columns. Whatever it does not decide (no answer) the planner decides in full.
"""

from __future__ import annotations

import numpy as np

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.chain_arrays import _INT_LIMIT, recompute_columns
from lightning_ckpt.planning.memory_model import end_need, end_relief, kept_elements, optimizer_need
from lightning_ckpt.planning.recompute_cost import metric_rates


def all_kept_optimum(cost: StepCost, budget: int, metric: str) -> tuple[int | float, int] | None:
    """(cost, peak) of the plan that keeps every block, when `solve_chain` at granularity "block"
    would return it: it fits, and every segment costs more than 0, so it is the only plan of cost 0.
    None when it does not fit or some segment may cost 0 (the full search decides then).

    [exactness] the demand is `_all_kept`'s over "keep" elements (`kept_element.need_bytes` is
    `ElementArrays.keep_need` in ints); the cheapest segment ending at each block is K[q] less the
    largest prefix sum before it, summed one by one as numpy's cumsum sums, in the solver's dtype.
    """
    rates = metric_rates(cost, metric)  # an unknown metric fails here as in `chain_arrays`
    n = cost.n_blocks
    if n == 0:
        return None
    opt, relief = optimizer_need(cost), end_relief(cost, True)
    d = end_need(cost)
    if opt > budget or d - relief > budget:
        return None  # no plan fits: `solve_chain` says so itself
    kept = kept_elements(cost)
    blocks = cost.blocks
    for p in range(n - 1, -1, -1):  # the end counts as a segment start: the last block's output held there
        d = max(kept[p].need_bytes, blocks[p].saved_bytes + d - (relief if p == n - 1 else 0))
        if d > budget:
            return None
    rc, tails, seg, scale, cdt = recompute_columns(cost, metric, rates)
    if not -_INT_LIMIT < seg < _INT_LIMIT:
        return None
    if cdt is not np.int64:  # each value as np.array(..., dtype=float64) converts it
        rc, tails = [float(c) for c in rc], [float(t) for t in tails]
    zero = 0 if cdt is np.int64 else 0.0
    prefix = most = zero  # P[q] and the largest of P[0..q]
    for c, t in zip(rc, tails):
        nxt = prefix + c
        if not nxt - t + seg - most > 0:  # a segment ending here costs 0 (or NaN): not decided here
            return None
        prefix = nxt
        most = max(most, prefix)
    return (zero / scale if scale != 1.0 else zero), max(d, opt)
