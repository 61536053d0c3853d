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

from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost
from lightning_ckpt.costs.linear_fit import _BLOCK_LINEAR, _SIGNED_TIMES, _STEP_LINEAR, _TAILS, held_writes

_OP_FIELDS = ("keep_bytes", "flops", "mem_bytes", "rng_bytes")
_INT_STEP = (*_STEP_LINEAR, "post_forward_bytes")
_MS = _BLOCK_LINEAR.index("fwd_ms")  # the one linear block field that stays a float
_INT_NAMES = tuple(f for f in _BLOCK_LINEAR if f != "fwd_ms")
_OP_NAMES = tuple(f.name for f in dataclasses.fields(OpCost))
_OP_SLOTS = tuple(_OP_NAMES.index(f) for f in _OP_FIELDS)  # where the combined sizes go among an op's fields


class CostCombination:
    """The quantities of `costs` (same blocks) as rows of one array; `combine(w)` is the cost whose every
    quantity is the combination `w` of theirs: bytes and counts rounded and at least 0, forward times at
    least 0, the kept-op time savings as they come, and a field that is unknown (None) in any cost unknown."""

    def __init__(self, costs: Sequence[StepCost]) -> None:
        self.first = first = costs[0]
        columns: list[list[float]] = []
        # the columns rounded to counts: `_counts` (at least 0 before rounding), `_op_counts` (after)
        counts: list[int] = []
        op_counts: list[int] = []
        # per block: (fields of the first, its first count, its peak's count or None, fwd_ms column,
        # signed time columns, ops (field values of each call, first op count) or None)
        self._blocks = []

        def add(values: Sequence, to: list[int] | None = None) -> int:
            columns.append([float(v) for v in values])
            if to is not None:
                to.append(len(columns) - 1)
            return len(columns) - 1

        for i in range(first.n_blocks):
            blocks = [c.blocks[i] for c in costs]
            base = {f.name: getattr(blocks[0], f.name) for f in dataclasses.fields(blocks[0])}
            base["chains_from_previous"] = all(b.chains_from_previous for b in blocks)
            base["unreplayable"] = held_writes(blocks)  # a write seen at any shape holds at every shape
            base["written_state_bytes"] = max(b.written_state_bytes for b in blocks)
            at = len(counts)
            for f in _BLOCK_LINEAR:
                add([getattr(b, f) for b in blocks], None if f == "fwd_ms" else counts)
            ms = len(columns) - len(_BLOCK_LINEAR) + _MS
            peaks = [b.ckpt_fwd_peak_bytes for b in blocks]
            peak = None
            if None not in peaks:
                add(peaks, counts)
                peak = len(counts) - 1
            signed = {}
            for f in _SIGNED_TIMES:
                values = [getattr(b, f) for b in blocks]
                signed[f] = None if None in values else add(values)
            keys = [tuple(o.key for o in b.ops) for b in blocks]
            ops = None
            if keys and all(k == keys[0] for k in keys):  # else no op-level options for that block there
                bases, op_at = [], len(op_counts)
                for calls in zip(*(b.ops for b in blocks)):
                    op = dataclasses.replace(
                        calls[0], saved=all(o.saved for o in calls), keepable=all(o.keepable for o in calls),
                        in_tail=all(o.in_tail for o in calls),
                    )
                    bases.append([getattr(op, f) for f in _OP_NAMES])  # the fields in order, sizes filled in below
                    for f in _OP_FIELDS:
                        add([getattr(o, f) for o in calls], op_counts)
                ops = (bases, op_at)
            self._blocks.append((base, at, peak, ms, signed, ops))
        self._step = {}
        for f in _INT_STEP:
            values = [getattr(c, f) for c in costs]
            self._step[f] = None
            if None not in values:
                add(values, counts)
                self._step[f] = len(counts) - 1
        self._flops = add([c.meta.get("step_fwd_flops", 0) for c in costs])
        self._rows = np.array(columns, dtype=float).T.copy() if columns else np.zeros((len(costs), 0))
        self._counts = np.array(counts, dtype=np.intp)
        self._op_counts = np.array(op_counts, dtype=np.intp)

    def combine(self, w: Sequence[float]) -> StepCost:
        acc = np.zeros(self._rows.shape[1])
        for weight, row in zip(w, self._rows):  # left to right, as a sum of products one by one
            acc = acc + float(weight) * row
        v = acc.tolist()
        # each as `int(round(max(0.0, x)))` and `max(0, int(round(x)))` one by one: `fmax` drops a NaN as
        # `max(0.0, nan)` does, `maximum` keeps it for `int` to refuse; rint rounds half to even as `round`
        counts = list(map(int, np.rint(np.fmax(acc[self._counts], 0.0)).tolist()))
        op_counts = list(map(int, np.maximum(np.rint(acc[self._op_counts]), 0.0).tolist()))
        blocks = []
        n_ops = len(_OP_FIELDS)
        for base, at, peak, ms, signed, ops in self._blocks:
            kw = dict(base)
            kw.update(zip(_INT_NAMES, counts[at : at + len(_INT_NAMES)]))
            kw["fwd_ms"] = max(0.0, v[ms])
            kw["ckpt_fwd_peak_bytes"] = None if peak is None else counts[peak]
            for f, col in signed.items():
                kw[f] = None if col is None else v[col]
            kw["input_saved_bytes"] = min(kw["input_saved_bytes"], kw["input_bytes"])
            kw["output_saved_bytes"] = min(kw["output_saved_bytes"], kw["output_bytes"])
            kw["input_saved_by_previous_bytes"] = min(kw["input_saved_by_previous_bytes"], kw["input_bytes"])
            for tail, whole in _TAILS:
                kw[tail] = min(kw[tail], kw[whole])
            if ops is None:
                kw["ops"] = ()
            else:
                bases, k = ops
                made = []
                for values in bases:
                    values = values.copy()
                    for slot, x in zip(_OP_SLOTS, op_counts[k : k + n_ops]):
                        values[slot] = x
                    made.append(OpCost(*values))
                    k += n_ops
                kw["ops"] = tuple(made)
            blocks.append(BlockCost(**kw))
        fields = {f: None if at is None else counts[at] for f, at in self._step.items()}
        meta = dict(self.first.meta)
        meta["step_fwd_flops"] = max(0.0, v[self._flops])
        return dataclasses.replace(self.first, blocks=tuple(blocks), meta=meta, **fields)


def combine_costs(costs: Sequence[StepCost], w: Sequence[float]) -> StepCost:
    """The step cost whose every quantity is the same linear combination `w` of the quantities of `costs`
    (`CostCombination`, for one combination)."""
    return CostCombination(costs).combine(w)
