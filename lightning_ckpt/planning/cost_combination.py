"""One step cost made of several (at one batch size, other shapes) as a linear combination of them, field by
field: the weights of a least-squares fit evaluated at one shape. `CostCombination` gathers the costs'
quantities into one array once, so that each shape costed from the same profiles is one pass over it,
with the same float operations in the same order as adding the products one by one (the same results).
Plain data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.linear_fit import _BLOCK_LINEAR, _SIGNED_TIMES, _STEP_LINEAR, _TAILS

_OP_FIELDS = ("keep_bytes", "flops", "mem_bytes", "rng_bytes")
_INT_STEP = (*_STEP_LINEAR, "post_forward_bytes")


class CostCombination:
    """The quantities of `costs` (same blocks) as rows of one array; `combine(w)` is the cost whose every
    quantity is the combination `w` of theirs: bytes and counts rounded and at least 0, forward times at
    least 0, the kept-op time savings as they come, and a field that is unknown (None) in any cost unknown."""

    def __init__(self, costs: Sequence[StepCost]) -> None:
        self.first = first = costs[0]
        columns: list[list[float]] = []
        self._blocks = []  # per block: (fields of the first, start column, peak?, signed?, ops (bases, start) or None)

        def add(values: Sequence) -> int:
            columns.append([float(v) for v in values])
            return len(columns) - 1

        for i in range(first.n_blocks):
            blocks = [c.blocks[i] for c in costs]
            base = {f.name: getattr(blocks[0], f.name) for f in dataclasses.fields(blocks[0])}
            start = len(columns)
            for f in _BLOCK_LINEAR:
                add([getattr(b, f) for b in blocks])
            peaks = [b.ckpt_fwd_peak_bytes for b in blocks]
            peak = None if None in peaks else add(peaks)
            signed = {}
            for f in _SIGNED_TIMES:
                values = [getattr(b, f) for b in blocks]
                signed[f] = None if None in values else add(values)
            keys = [tuple(o.key for o in b.ops) for b in blocks]
            ops = None
            if keys and all(k == keys[0] for k in keys):  # else no op-level options for that block there
                bases, op_start = [], len(columns)
                for calls in zip(*(b.ops for b in blocks)):
                    bases.append(dataclasses.replace(
                        calls[0], saved=all(o.saved for o in calls), keepable=all(o.keepable for o in calls),
                        in_tail=all(o.in_tail for o in calls),
                    ))
                    for f in _OP_FIELDS:
                        add([getattr(o, f) for o in calls])
                ops = (bases, op_start)
            chains = all(b.chains_from_previous for b in blocks)
            self._blocks.append((base, start, peak, signed, ops, chains))
        self._step = {}
        for f in _INT_STEP:
            values = [getattr(c, f) for c in costs]
            self._step[f] = None if None in values else add(values)
        self._flops = add([c.meta.get("step_fwd_flops", 0) for c in costs])
        self._rows = np.array(columns, dtype=float).T.copy() if columns else np.zeros((len(costs), 0))

    def combine(self, w: Sequence[float]) -> StepCost:
        acc = np.zeros(self._rows.shape[1])
        for weight, row in zip(w, self._rows):  # left to right, as a sum of products one by one
            acc = acc + float(weight) * row
        v = acc.tolist()
        blocks = []
        for base, start, peak, signed, ops, chains in self._blocks:
            kw = dict(base)
            for j, f in enumerate(_BLOCK_LINEAR):
                x = max(0.0, v[start + j])
                kw[f] = x if f == "fwd_ms" else int(round(x))
            kw["ckpt_fwd_peak_bytes"] = None if peak is None else int(round(max(0.0, v[peak])))
            for f, col in signed.items():
                kw[f] = None if col is None else v[col]
            kw["input_saved_bytes"] = min(kw["input_saved_bytes"], kw["input_bytes"])
            kw["output_saved_bytes"] = min(kw["output_saved_bytes"], kw["output_bytes"])
            kw["input_saved_by_previous_bytes"] = min(kw["input_saved_by_previous_bytes"], kw["input_bytes"])
            for tail, whole in _TAILS:
                kw[tail] = min(kw[tail], kw[whole])
            kw["chains_from_previous"] = chains
            if ops is None:
                kw["ops"] = ()
            else:
                bases, at = ops
                n = len(_OP_FIELDS)
                kw["ops"] = tuple(
                    dataclasses.replace(
                        op, **{f: max(0, int(round(v[at + n * k + j]))) for j, f in enumerate(_OP_FIELDS)}
                    )
                    for k, op in enumerate(bases)
                )
            blocks.append(BlockCost(**kw))
        fields = {f: None if col is None else int(round(max(0.0, v[col]))) for f, col in self._step.items()}
        meta = dict(self.first.meta)
        meta["step_fwd_flops"] = max(0.0, v[self._flops])
        return dataclasses.replace(self.first, blocks=tuple(blocks), meta=meta, **fields)


def combine_costs(costs: Sequence[StepCost], w: Sequence[float]) -> StepCost:
    """The step cost whose every quantity is the same linear combination `w` of the quantities of `costs`
    (`CostCombination`, for one combination)."""
    return CostCombination(costs).combine(w)
