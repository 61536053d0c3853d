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

from lightning_ckpt.profiling.memory.collective_release import call_op
from lightning_ckpt.profiling.work.op_bytes import WorkTally
from lightning_ckpt.profiling.work.op_traits import OpTraits, traits_of
from lightning_ckpt.profiling.work.tp_work import any_fake, dtensor_in, has_dtensor
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker, flat_tensors, storage_key

__all__ = ["LocalWork", "ProbeCounters"]

_PRIM_DEVICE = torch.ops.prim.device.default


def _op_flops(traits: OpTraits, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op that runs as it is, by torch's formulas (`torch.utils.flop_counter`)."""
    formula = traits.formula
    if formula is None:
        return 0
    inner = traits.shape_formula
    if inner is not None:
        # what that wrapper passes (tensors as their shapes), without its general tree_map
        try:
            shapes, kw_shapes, out_shape = _shape_list(args), _shape_of(kwargs), _shape_of(out)
        except _Unmapped:
            pass
        else:
            return int(inner(*shapes, out_shape=out_shape, **kw_shapes))
    return int(formula(*args, **kwargs, out_val=out))


class _Unmapped(Exception):
    """A container `_shape_of` leaves to torch's own tree_map (a named tuple: it keeps its type)."""


def _shape_of(v: Any) -> Any:
    """`tree_map(get_shape, v)` of `torch.utils.flop_counter` for plain tuples, lists and dicts."""
    if isinstance(v, torch.Tensor):
        return v.shape
    kind = type(v)
    if kind is tuple:
        return tuple(_shape_list(v))
    if kind is list:
        return _shape_list(v)
    if kind is dict:
        return dict(zip(v.keys(), _shape_list(v.values())))
    if isinstance(v, (tuple, list, dict)):
        raise _Unmapped
    return v


def _shape_list(values: Any) -> list:
    return [
        x.shape if isinstance(x, torch.Tensor) else _shape_of(x) if isinstance(x, (tuple, list, dict)) else x
        for x in values
    ]


class _DecomposedFlops(TorchDispatchMode):
    """Counts FLOPs only, into `owner`, while an op runs its decomposition: what
    `FlopCounterMode` does, so the composite op itself is what the other counts see."""

    def __init__(self, owner: "_FlopCounting") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        traits = traits_of(func)
        if traits.query:
            return NotImplemented
        return self.owner._run_counting_flops(func, args, kwargs or {}, self, None, traits)


class _FlopCounting:
    """`total_flops`, counted as torch's FLOP counter counts them; a DTensor op by its local work,
    gathered in `self.local` (a `LocalWork`, or None when the op held no DTensor)."""

    total_flops: int
    local: "LocalWork | None"

    def _run_counting_flops(
        self, func: Any, args: tuple, kwargs: dict, mode: TorchDispatchMode, flat: list | None, traits: OpTraits
    ) -> Any:
        """`flat`: the tensors in (args, kwargs), when the caller has them; `traits`: `traits_of(func)`."""
        # [as FlopCounterMode] an op with a decomposition runs it, with the FLOPs of the ops it
        # decomposes into counted (that counter looks an overload up among packets: never found)
        if func is not _PRIM_DEVICE and traits.decomposes():
            with _DecomposedFlops(self) if mode is self else mode:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if dtensor_in(flat) if flat is not None else has_dtensor((args, kwargs)):
            # [constraint] the rank runs it on local shards (redistributed first when the op needs
            # it): those ops are what it costs here, seen by a mode of their own below DTensor's dispatch
            local = self.local = self.local or LocalWork(getattr(self, "track_local", None))
            before = local.total_flops
            with local:
                out = func(*args, **kwargs)
            self.total_flops += local.total_flops - before
            return out
        # a collective waited for where issued (`collective_release`)
        out = call_op(func, args, kwargs) if traits.issued else func(*args, **kwargs)
        self.total_flops += _op_flops(traits, args, kwargs, out)
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
        traits = traits_of(func)
        if traits.query or has_dtensor((args, kwargs)):
            return NotImplemented  # DTensor's dispatch runs it, and the local ops come back here
        if any_fake((args, kwargs)):  # sharding propagation infers shapes on fake tensors: no work done
            return func(*args, **kwargs)
        before = self.total_flops
        out = self._run_counting_flops(func, args, kwargs, self, None, traits)
        outs = flat_tensors(out)
        self.tally(func, args, kwargs, out, outs, self.total_flops - before, traits=traits)
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
        traits = traits_of(func)
        if traits.query:
            return NotImplemented
        kwargs = kwargs or {}
        if self.before_op is not None:
            self.before_op()
        before = self.total_flops
        self.local = None
        # the same tensors after the op; their storages are read after it
        flat = flat_tensors((args, kwargs)) if kwargs else flat_tensors(args)
        if self.limit_bytes is not None:
            self.check_before(func, args, kwargs, flat)
        if (func is not _PRIM_DEVICE and traits.decomposes()) or dtensor_in(flat):
            out = self._run_counting_flops(func, args, kwargs, self, flat, traits)
        else:  # what `_run_counting_flops` does for an op that runs as it is, inline: most ops are
            out = call_op(func, args, kwargs) if traits.issued else func(*args, **kwargs)
            if traits.formula is not None:
                self.total_flops += _op_flops(traits, args, kwargs, out)
        local, self.local = self.local, None
        # Views and in-place results share an input's storage: never a new one (see the tracker)
        inputs = {storage_key(t) for t in flat}
        outs = flat_tensors(out)
        out_keys = [storage_key(t) for t in outs]
        self.tally(func, args, kwargs, out, outs, self.total_flops - before, inputs, local, out_keys, traits)
        if self.ledger is not None:
            self.ledger.used(inputs)
        for t, key in zip(outs, out_keys):
            if key not in inputs:
                self._track(t, key)
        return out
