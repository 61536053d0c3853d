"""The columns the exact chain planner works on: the element form of `memory_model`
(`element_arrays.ElementArrays`) plus chaining, recompute in solver units, and the op-level options of
each block (`op_options`) when planning at granularity "op".

Bytes are int64. Recompute in `flops` is int64 (float64 only if the sum of all block
FLOPs exceeds 2**62); in `time` each block's estimate is rounded to whole nanoseconds
(int64, so plans of equal cost tie exactly); in `ms` it is float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.element_arrays import (
    ElementArrays,
    element_arrays,
    single_segment_parts,
)
from lightning_ckpt.planning.op_options import GRANULARITIES, step_options
from lightning_ckpt.planning.recompute_cost import (
    block_recompute,
    metric_rates,
    segment_overhead,
    skipped_tail,
)

_INT_LIMIT = 2**62
_NS_PER_MS = 1e6


@dataclass
class ChainArrays(ElementArrays):
    """The element form's columns plus what the DP adds: chaining and recompute."""

    # first block k > p that does not chain from k - 1, is a must-keep block or follows one (n if none)
    next_break: np.ndarray
    rc: np.ndarray  # block recompute
    tails: np.ndarray  # skipped tail when the block ends a segment
    P: np.ndarray  # prefix sums of block recompute (n + 1)
    K: np.ndarray  # K[q] = P[q] - tail[q - 1] + segment overhead (n + 1, K[0] unused)
    cost_scale: float = 1.0  # solver cost units per unit of the metric (time: ns per ms)
    # op-level options of each block (`op_options`): kept bytes, recompute avoided, kept calls
    opt_k: list = field(default_factory=list)
    opt_v: list = field(default_factory=list)
    opt_keys: list = field(default_factory=list)
    one_fwd: np.ndarray | None = None  # forward and backward of each one-block segment
    one_bwd: np.ndarray | None = None
    must_keep: np.ndarray | None = None  # blocks no segment may hold (`BlockCost.unreplayable`); None: none


def recompute_columns(cost: StepCost, metric: str, rates) -> tuple[list, list, int | float, float, type]:
    """Per block, the recompute and the skipped tail in solver units (lists), the segment overhead,
    the solver units per unit of the metric and the dtype the solver sums them in."""
    blocks = cost.blocks
    rc = [block_recompute(b, metric, rates) for b in blocks]
    tails = [skipped_tail(b, metric, rates) for b in blocks]
    # [constraint] every segment ends at exactly one block: its fixed overhead goes with the end
    seg = segment_overhead(metric, rates) if metric == "time" else 0  # an int: FLOPs stay exact
    scale = 1.0
    if metric == "time":
        # [exactness] estimated times in whole nanoseconds, summed as int64: plans of
        # equal cost tie exactly, so the lower peak wins and not a rounding error
        scale = _NS_PER_MS
        rc = [int(round(c * scale)) for c in rc]
        tails = [int(round(c * scale)) for c in tails]
        seg = int(round(seg * scale))
    integral = metric != "ms" and all(isinstance(c, int) for c in rc + tails) and sum(rc) + sum(tails) < _INT_LIMIT
    return rc, tails, seg, scale, np.int64 if integral else np.float64


def chain_arrays(cost: StepCost, metric: str, granularity: str = "block", max_options: int | None = None) -> ChainArrays:
    blocks = cost.blocks
    n = len(blocks)
    rates = metric_rates(cost, metric)
    rc, tails, seg, scale, cdt = recompute_columns(cost, metric, rates)
    P = np.zeros(n + 1, dtype=cdt)
    np.cumsum(np.array(rc, dtype=cdt), out=P[1:])
    K = np.zeros(n + 1, dtype=cdt)
    K[1:] = P[1:] - np.array(tails, dtype=cdt) + seg
    next_break = np.full(n, n, dtype=np.int64)
    nb = n
    held = np.array([bool(b.unreplayable) for b in blocks], dtype=bool)
    for k in range(n - 1, -1, -1):
        next_break[k] = nb
        # [constraint] a block that must stay kept ends every segment before it (and after it)
        if not blocks[k].chains_from_previous or held[k]:
            nb = k
        if k + 1 < n and held[k]:
            next_break[k] = min(int(next_break[k]), k + 1)
    mem = element_arrays(cost)
    out = ChainArrays(
        **vars(mem), next_break=next_break, rc=np.array(rc, dtype=cdt), tails=np.array(tails, dtype=cdt), P=P, K=K,
        cost_scale=scale, must_keep=held if held.any() else None,
    )
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not known; choose one of {', '.join(GRANULARITIES)}.")
    if granularity == "op":
        for opts in step_options(cost, metric, rates, max_options):
            out.opt_k.append(np.array([o.keep_bytes for o in opts], dtype=np.int64))
            vals = [o.value * scale for o in opts]
            out.opt_v.append(np.array([int(round(v)) for v in vals] if cdt == np.int64 else vals, dtype=cdt))
            out.opt_keys.append([o.keys for o in opts])
        out.one_fwd, out.one_bwd = single_segment_parts(out)
    return out
