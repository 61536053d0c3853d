"""One dispatch mode for a probe: live bytes, FLOPs and the bytes ops write, counted together.

A probe needs all three for every op. Stacked as three dispatch modes (`LiveBytesTracker`,
`OpBytesCounter`, `FlopCounterMode`) each op crosses Python dispatch three times: measured on
the encoder example at batch 4, that made the probe's forward and backward 1.8x a plain one.
`ProbeCounters` counts the same numbers in one crossing; `tests/test_probe_counters.py` checks
it against the three stacked modes. It tracks no modules: every FLOP is global (torch's counter
hooks every module's outputs for the backward and holds their gradients until all of a module's
outputs have one; a T5 block's position bias never gets one, so a live-bytes probe saw them).
An op on DTensors (tensor parallelism) is seen once, with global shapes, and counted by the work
its rank does on local shards (`LocalWork`): FLOPs, bytes written and the collectives it runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from lightning_ckpt.profiling.collective_release import call_op
from lightning_ckpt.profiling.op_bytes import WorkTally
from lightning_ckpt.profiling.tp_work import any_fake, has_dtensor
from lightning_ckpt.profiling.tracker import LiveBytesTracker, flat_tensors, storage_key

__all__ = ["LocalWork", "ProbeCounters"]

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

    def __init__(self, owner: "_FlopCounting") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERIES:
            return NotImplemented
        return self.owner._run_counting_flops(func, args, kwargs, self)


class _FlopCounting:
    """`total_flops`, counted as torch's FLOP counter counts them; a DTensor op by its local work,
    gathered in `self.local` (a `LocalWork`, or None when the op held no DTensor)."""

    total_flops: int
    local: "LocalWork | None"

    def _run_counting_flops(self, func: Any, args: tuple, kwargs: dict, mode: TorchDispatchMode) -> Any:
        # [as FlopCounterMode] an op with a decomposition runs it, with the FLOPs of the ops it
        # decomposes into counted (that counter looks an overload up among packets: never found)
        if func is not torch.ops.prim.device.default:
            with _DecomposedFlops(self) if mode is self else mode:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if has_dtensor((args, kwargs)):
            # [constraint] the rank runs it on local shards (redistributed first when the op needs
            # it): those ops are what it costs here, seen by a mode of their own below DTensor's dispatch
            local = self.local = self.local or LocalWork(getattr(self, "track_local", None))
            before = local.total_flops
            with local:
                out = func(*args, **kwargs)
            self.total_flops += local.total_flops - before
            return out
        out = call_op(func, args, kwargs)  # a collective waited for where issued (`collective_release`)
        self.total_flops += _op_flops(func, args, kwargs, out)
        return out


class LocalWork(_FlopCounting, TorchDispatchMode, WorkTally):
    """The work DTensor ops do on this rank's local tensors: entered around a DTensor op, it lets
    DTensor's dispatch handle every op on DTensors and counts the plain ops that dispatch runs
    (the local compute, the functional collectives of a redistribution) as `ProbeCounters` does."""

    def __init__(self, track: Any = None) -> None:
        super().__init__()
        self._init_tally()
        self.total_flops = 0
        self.local = None
        self.track = track  # told of every new local storage (the probe's live bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERIES or has_dtensor((args, kwargs)):
            return NotImplemented  # DTensor's dispatch runs it, and the local ops come back here
        if any_fake((args, kwargs)):  # sharding propagation infers shapes on fake tensors: no work done
            return func(*args, **kwargs)
        before = self.total_flops
        out = self._run_counting_flops(func, args, kwargs, self)
        outs = flat_tensors(out)
        self.tally(func, args, kwargs, out, outs, self.total_flops - before)
        if self.track is not None:  # scratch of the DTensor op (a redistribution, a loss's partial sums)
            inputs = {storage_key(t) for t in flat_tensors((args, kwargs))}
            for t in outs:
                if storage_key(t) not in inputs:
                    self.track(t)
        return out


class ProbeCounters(_FlopCounting, LiveBytesTracker, WorkTally):
    """`LiveBytesTracker` that also counts FLOPs (`get_total_flops`) and the work `WorkTally`
    keeps, so a `Probe` needs one mode. The counts equal those of a `LiveBytesTracker`
    stacked above an `OpBytesCounter` above a `FlopCounterMode` with every FLOP global; an op
    on DTensors counts the work of its local shards (`LocalWork`)."""

    def __init__(self, device: str | None = None, ledger: Any = None) -> None:
        super().__init__(device=device, ledger=ledger)
        self._init_tally()
        self.total_flops = 0
        self.local = None

    def get_total_flops(self) -> int:
        return self.total_flops

    def track_local(self, t: torch.Tensor) -> None:
        """A storage an op on DTensors made on this rank: live bytes like any other."""
        self._track(t)

    def snapshot(self) -> tuple[int, int, int]:
        """(mem_bytes, rng_bytes, comm_bytes) so far."""
        return self.mem_bytes, self.rng_bytes, self.comm_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERIES:
            return NotImplemented
        before = self.total_flops
        self.local = None
        out = self._run_counting_flops(func, args, kwargs, self)
        local, self.local = self.local, None
        # Views and in-place results share an input's storage: never a new one (see the tracker)
        inputs = {storage_key(t) for t in flat_tensors((args, kwargs))}
        outs = flat_tensors(out)
        self.tally(func, args, kwargs, out, outs, self.total_flops - before, inputs, local)
        if self.ledger is not None:
            self.ledger.used(inputs)
        for t in outs:
            if storage_key(t) not in inputs:
                self._track(t)
        return out
