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

_OP_FIELDS = ("keep_bytes", "flops", "mem_bytes", "rng_bytes")  # the op counts of each call, in this order
_INT_STEP = (*_STEP_LINEAR, "post_forward_bytes")
_INT_NAMES = tuple(f for f in _BLOCK_LINEAR if f != "fwd_ms")  # fwd_ms is the one linear float
_OP_NAMES = tuple(f.name for f in dataclasses.fields(OpCost))


class CostCombination:
    """The quantities of `costs` (same blocks) as rows of one array; `combine(w)` is the cost whose every
    quantity is the combination `w` of theirs: bytes and counts rounded and at least 0, forward times at
    least 0, the kept-op time savings as they come, and a field that is unknown (None) in any cost unknown."""

    def __init__(self, costs: Sequence[StepCost]) -> None:
        self.first = first = costs[0]
        # the columns in three runs, each a column per quantity: counts (at least 0 before rounding), op
        # counts (after), then floats; a count's index is its place among the counts, an op count's among
        # the op counts, a float's among the floats
        counts: list[list[float]] = []
        op_counts: list[list[float]] = []
        floats: list[list[float]] = []

        def add(values: Sequence, to: list[list[float]]) -> int:
            to.append([float(v) for v in values])
            return len(to) - 1

        # per block: (fields of the first, its first count, its peak's count or None, its kept-gradient
        # backward peak's count or None, fwd_ms float, signed time floats, the fields of each op call: none
        # when the costs' calls differ)
        self._blocks = []
        for i in range(first.n_blocks):
            blocks = [c.blocks[i] for c in costs]
            base = {f.name: getattr(blocks[0], f.name) for f in dataclasses.fields(blocks[0])}
            base["chains_from_previous"] = all(b.chains_from_previous for b in blocks)
            base["unreplayable"] = held_writes(blocks)  # a write seen at any shape holds at every shape
            base["written_state_bytes"] = max(b.written_state_bytes for b in blocks)
            base["bwd_phase_bytes"] = ()  # a probe's stretches: the combined backward scratch is in its two peaks
            at = len(counts)
            for f in _INT_NAMES:
                add([getattr(b, f) for b in blocks], counts)
            ms = add([b.fwd_ms for b in blocks], floats)
            peaks = [b.ckpt_fwd_peak_bytes for b in blocks]
            peak = None if None in peaks else add(peaks, counts)
            kepts = [b.kept_grads_bwd_transient_bytes for b in blocks]
            kept = None if None in kepts else add(kepts, counts)
            signed = {}
            for f in _SIGNED_TIMES:
                values = [getattr(b, f) for b in blocks]
                signed[f] = None if None in values else add(values, floats)
            keys = [tuple(o.key for o in b.ops) for b in blocks]
            ops = []  # the fields of each op call in order, sizes filled in by `combine`
            if keys and all(k == keys[0] for k in keys):  # else no op-level options for that block there
                for calls in zip(*(b.ops for b in blocks)):
                    op = dataclasses.replace(
                        calls[0], saved=all(o.saved for o in calls), keepable=all(o.keepable for o in calls),
                        in_tail=all(o.in_tail for o in calls),
                    )
                    ops.append({f: getattr(op, f) for f in _OP_NAMES})
                    for f in _OP_FIELDS:
                        add([getattr(o, f) for o in calls], op_counts)
            self._blocks.append((base, at, peak, kept, ms, signed, ops))
        self._step = {}
        for f in _INT_STEP:
            values = [getattr(c, f) for c in costs]
            self._step[f] = None if None in values else add(values, counts)
        self._flops = add([c.meta.get("step_fwd_flops", 0) for c in costs], floats)
        self._step_base = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)}
        self._n_counts, self._n_ints = len(counts), len(counts) + len(op_counts)
        columns = counts + op_counts + floats
        self._rows = np.array(columns, dtype=float).T.copy()

    def combine(self, w: Sequence[float]) -> StepCost:
        rows = self._rows[: len(w)]
        products = np.array(w[: len(rows)], dtype=float)[:, None] * rows  # each `float(weight) * row`
        # summed from 0.0 row after row: numpy sums pairwise only along a contiguous axis, and the columns
        # (at least the step's four counts and its FLOPs) make the first axis a strided one
        acc = np.add.reduce(products, axis=0, initial=0.0)
        nc, ni = self._n_counts, self._n_ints
        # each as `int(round(max(0.0, x)))` (counts) and `max(0, int(round(x)))` (op counts), one by one: rint
        # rounds half to even as `round` and commutes with the bound at 0; `fmax` drops a NaN as `max(0.0, nan)`
        # does, `maximum` keeps it for `int` to refuse; below 2**63 `int64` holds every rounded float exactly
        y = np.rint(acc[:ni])
        np.fmax(y[:nc], 0.0, out=y[:nc])
        np.maximum(y[nc:], 0.0, out=y[nc:])
        ints = y.astype(np.int64).tolist() if y.max(initial=0.0) < 2.0**63 else list(map(int, y.tolist()))
        counts, sizes, v = ints[:nc], ints[nc:], acc[ni:].tolist()
        blocks = []
        n_int = len(_INT_NAMES)
        k = 0  # the next op count: each op call takes the next four, in the order of `_OP_FIELDS`
        new, setattr_ = object.__new__, object.__setattr__
        for base, at, peak, kept, ms, signed, ops in self._blocks:
            kw = base.copy()
            kw.update(zip(_INT_NAMES, counts[at : at + n_int]))
            kw["fwd_ms"] = max(0.0, v[ms])
            kw["ckpt_fwd_peak_bytes"] = None if peak is None else counts[peak]
            kw["kept_grads_bwd_transient_bytes"] = None if kept is None else min(counts[kept], kw["bwd_transient_bytes"])
            for f, col in signed.items():
                kw[f] = None if col is None else v[col]
            whole = kw["input_bytes"]
            kw["input_saved_bytes"] = min(kw["input_saved_bytes"], whole)
            kw["output_saved_bytes"] = min(kw["output_saved_bytes"], kw["output_bytes"])
            kw["stop_output_bytes"] = min(kw["stop_output_bytes"], kw["output_bytes"] - kw["output_saved_bytes"])
            kw["input_saved_by_previous_bytes"] = min(kw["input_saved_by_previous_bytes"], whole)
            for tail, whole in _TAILS:
                kw[tail] = min(kw[tail], kw[whole])
            made = []
            for values in ops:  # as `_filled(OpCost, values)` with the four sizes in, made inline (many per cost)
                values = values.copy()
                values["keep_bytes"], values["flops"], values["mem_bytes"], values["rng_bytes"] = sizes[k : k + 4]
                k += 4
                op = new(OpCost)
                setattr_(op, "__dict__", values)
                made.append(op)
            kw["ops"] = tuple(made)
            # [exactness] every size above is a count >= 0 or the least of two, and every other field the first
            # cost's (checked when it was made): of `BlockCost`'s checks only the unsaved input can fail here
            blocks.append(_filled(BlockCost, kw) if kw["input_unsaved_bytes"] <= kw["input_bytes"] else BlockCost(**kw))
        step = self._step_base.copy()
        step["blocks"] = tuple(blocks)
        step.update((f, None if at is None else counts[at]) for f, at in self._step.items())
        step["meta"] = meta = dict(self.first.meta)
        meta["step_fwd_flops"] = max(0.0, v[self._flops])
        # the blocks' gradients outside them and `outside_grad_bytes` are the first cost's: its check holds
        return _filled(StepCost, step)


def _filled(cls: type, values: dict):
    """An instance of the frozen dataclass `cls` with `values` (every field, in field order) as its fields, made
    without `__init__`: no `__post_init__` checks, and none of the per-field `object.__setattr__` calls."""
    made = object.__new__(cls)
    object.__setattr__(made, "__dict__", values)
    return made


_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepCost))


def with_pre_saved(cost: StepCost, reserve: int) -> StepCost:
    """`dataclasses.replace(cost, pre_saved_bytes=cost.pre_saved_bytes + reserve)`, made without `__init__`: every
    other field is the cost's, and `StepCost`'s one check (the gradients outside the blocks) reads none of what
    changes: it held when the cost was made."""
    values = dict(cost.__dict__)
    if len(values) != len(_STEP_FIELDS):  # an attribute beside the fields: `replace` drops it
        return dataclasses.replace(cost, pre_saved_bytes=cost.pre_saved_bytes + reserve)
    values["pre_saved_bytes"] = cost.pre_saved_bytes + reserve
    return _filled(StepCost, values)


def combine_costs(costs: Sequence[StepCost], w: Sequence[float]) -> StepCost:
    """The step cost whose every quantity is the same linear combination `w` of the quantities of `costs`
    (`CostCombination`, for one combination)."""
    return CostCombination(costs).combine(w)
