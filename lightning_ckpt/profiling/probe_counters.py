"""One dispatch mode for a probe: live bytes, FLOPs and the bytes ops write, counted together.

A probe needs all three for every op. Stacked as three dispatch modes (`LiveBytesTracker`,
`OpBytesCounter`, `FlopCounterMode`) each op crosses Python dispatch three times: measured on
the encoder example at batch 4, that made the probe's forward and backward 1.8x a plain one.
`ProbeCounters` counts the same numbers in one crossing; `tests/test_probe_counters.py` checks
it against the three stacked modes. It tracks no modules: every FLOP is global (torch's counter
hooks every module's outputs for the backward and holds their gradients until all of a module's
outputs have one; a T5 block's position bias never gets one, so a live-bytes probe saw them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from lightning_ckpt.profiling.op_bytes import WorkTally
from lightning_ckpt.profiling.tracker import LiveBytesTracker, flat_tensors, storage_key

__all__ = ["ProbeCounters"]

_aten = torch.ops.aten
# metadata queries that torch's FLOP counter leaves to tensor subclasses (nested tensors)
_QUERIES = {
    _aten.sym_is_contiguous.default,
    _aten.is_contiguous.default,
    _aten.is_contiguous.memory_format,
    _aten.is_strides_like_format.default,
    _aten.is_non_overlapping_and_dense.default,
    _aten.size.default,
    _aten.sym_size.default,
    _aten.stride.default,
    _aten.sym_stride.default,
    _aten.storage_offset.default,
    _aten.sym_storage_offset.default,
    _aten.numel.default,
    _aten.sym_numel.default,
    _aten.dim.default,
    torch.ops.prim.layout.default,
}


def _op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op that runs as it is, by torch's formulas (`torch.utils.flop_counter`)."""
    formula = flop_registry.get(func._overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


class _DecomposedFlops(TorchDispatchMode):
    """Counts FLOPs only, into `owner`, while an op runs its decomposition: what
    `FlopCounterMode` does, so the composite op itself is what the other counts see."""

    def __init__(self, owner: "ProbeCounters") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERIES:
            return NotImplemented
        return self.owner._run_counting_flops(func, args, kwargs, self)


class ProbeCounters(LiveBytesTracker, WorkTally):
    """`LiveBytesTracker` that also counts FLOPs (`get_total_flops`) and the work `WorkTally`
    keeps, so a `Probe` needs one mode. The counts equal those of a `LiveBytesTracker`
    stacked above an `OpBytesCounter` above a `FlopCounterMode` with every FLOP global."""

    def __init__(self, device: str | None = None, ledger: Any = None) -> None:
        super().__init__(device=device, ledger=ledger)
        self._init_tally()
        self.total_flops = 0

    def get_total_flops(self) -> int:
        return self.total_flops

    def _run_counting_flops(self, func: Any, args: tuple, kwargs: dict, mode: TorchDispatchMode) -> Any:
        # [as FlopCounterMode] an op with a decomposition runs it, with the FLOPs of the ops it
        # decomposes into counted (that counter looks an overload up among packets: never found)
        if func is not torch.ops.prim.device.default:
            with _DecomposedFlops(self) if mode is self else mode:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self.total_flops += _op_flops(func, args, kwargs, out)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERIES:
            return NotImplemented
        before = self.total_flops
        out = self._run_counting_flops(func, args, kwargs, self)
        # Views and in-place results share an input's storage: never a new one (see the tracker)
        inputs = {storage_key(t) for t in flat_tensors((args, kwargs))}
        outs = flat_tensors(out)
        self.tally(func, args, kwargs, out, outs, self.total_flops - before, inputs)
        if self.ledger is not None:
            self.ledger.used(inputs)
        for t in outs:
            if storage_key(t) not in inputs:
                self._track(t)
        return out
