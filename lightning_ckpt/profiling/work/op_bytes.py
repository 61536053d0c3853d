"""Bytes written by the ops torch's FLOP counter gives no FLOPs.

`FlopCounterMode` counts matmul- and convolution-like ops only; layer norm, softmax,
GELU, dropout, embedding lookups, batch norm, relu and adds count 0 FLOPs but take
real time. `OpBytesCounter` is a dispatch mode stacked above a `FlopCounterMode`: each
op that counter gives 0 FLOPs adds the bytes it writes to `mem_bytes`, or to
`rng_bytes` when it draws random numbers (dropout's `bernoulli_`), which is much
slower per byte on CPU. What an op writes is defined in `written_bytes`; a functional
collective (tensor parallel's all-reduce, all-gather, reduce-scatter) adds to `comm_bytes`
instead (`tp_work.collective_bytes`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt.profiling.work.tp_work import collective_bytes, is_collective
from lightning_ckpt.profiling.memory.tracker import flat_tensors, storage_key

__all__ = ["OpBytesCounter", "WorkTally", "is_random", "write_kind", "written_bytes"]

_aten = torch.ops.aten
# Ops that allocate or re-point storage without writing any data.
_NO_WRITE = {
    _aten.empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.empty_permuted,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten.resize_,
    _aten.set_,
    _aten.lift_fresh,
}

_UNSEEN = object()


def written_bytes(
    func: Any, args: tuple, kwargs: dict, out: Any, inputs: set | None = None, outs: list | None = None,
    out_keys: list | None = None, kind: Any = _UNSEEN,
) -> int:
    """Bytes `func` wrote: numel x element size of every tensor it returns, except views.

    A returned tensor on the storage of an input is a view (`view`, `t`, `_unsafe_view`,
    `detach`: 0 bytes) unless the op mutates its inputs (`add_`, `bernoulli_`, `copy_`:
    the mutated tensor's bytes). Allocation-only ops (`empty`, `empty_like`, ...) write
    nothing. Only outputs count, not bytes read: a single rate per byte written,
    measured on a mix of ops (`rates.measure_rates`), absorbs the reads. `inputs`, when
    given, are the storage keys of the arguments (a dispatch mode that has them already);
    `outs` and `out_keys` the tensors in `out` and their storage keys, likewise; `kind`, `write_kind(func)`.
    """
    mutable = write_kind(func) if kind is _UNSEEN else kind
    if mutable is None:
        return 0  # not an aten-style op (no schema), or one that writes nothing
    if outs is None:
        outs = flat_tensors(out)
        out_keys = None
    if not outs:
        return 0
    if mutable:
        return sum(t.numel() * t.element_size() for t in outs)
    if inputs is None:
        inputs = {storage_key(t) for t in flat_tensors((args, kwargs))}
    if None in inputs:
        inputs = inputs - {None}
    if out_keys is None:
        out_keys = [storage_key(t) for t in outs]
    return sum(t.numel() * t.element_size() for t, key in zip(outs, out_keys) if key not in inputs)

_WRITES: dict[Any, bool | None] = {}  # op overload -> `write_kind` (read off its schema, which never changes)


def write_kind(func: Any) -> bool | None:
    """None for an op that writes no data (no schema, allocation only, a view); else whether it mutates
    its arguments (its schema says so: every output counts) or only makes new outputs."""
    found = _WRITES.get(func, _UNSEEN)
    if found is not _UNSEEN:
        return found
    schema = getattr(func, "_schema", None)
    if schema is None or getattr(func, "_overloadpacket", None) in _NO_WRITE or getattr(func, "is_view", False):
        found = None
    else:
        found = bool(schema.is_mutable)
    _WRITES[func] = found
    return found


_RANDOM: dict[Any, bool] = {}  # op overload -> whether it draws random numbers (its tags never change)


def is_random(func: Any) -> bool:
    """Whether op `func` draws random numbers (its tags say so)."""
    found = _RANDOM.get(func)
    if found is None:
        found = _RANDOM[func] = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    return found


_COLLECTIVE: dict[Any, bool] = {}  # op overload -> `tp_work.is_collective` (its namespace never changes)
_DEVICE_NAMES: dict[torch.device, str] = {}


def _is_collective(func: Any) -> bool:
    found = _COLLECTIVE.get(func)
    if found is None:
        found = _COLLECTIVE[func] = is_collective(func)
    return found


def _device_name(device: torch.device) -> str:
    found = _DEVICE_NAMES.get(device)
    if found is None:
        found = _DEVICE_NAMES[device] = str(device)
    return found


class WorkTally:
    """Running totals of the work ops did: FLOPs by dtype, bytes written, random bytes drawn,
    bytes moved by functional collectives (`comm_bytes`, as all-gather outputs: `tp_work`).

    `mem_bytes`, `rng_bytes` and `comm_bytes` are running totals (read them before and after a region).
    `flop_dtypes` and `mem_dtypes` weigh each (device, dtype) by the FLOPs or bytes done in
    it, so the machine rates can be measured where the work is. `on_op`, when set, is
    called after each op with `(func, args, kwargs, outs, flops, mem_bytes, rng_bytes)`: its
    tensor outputs and its own share of the counts (`op_profile.OpProfileRecorder.record`
    takes exactly these). The dispatch modes that feed it call `tally` once per op.
    """

    def _init_tally(self) -> None:
        self.mem_bytes = 0
        self.rng_bytes = 0
        self.comm_bytes = 0
        self.flop_dtypes: Counter[tuple[str, torch.dtype]] = Counter()
        self.mem_dtypes: Counter[tuple[str, torch.dtype]] = Counter()
        self.on_op: Callable[..., None] | None = None
        # (inputs, out_keys) of the op `on_op` is told of, as `tally` was given them (None: not known)
        self.op_keys: tuple[set | None, list | None] = (None, None)
        self.op_traits: Any = None  # and its `op_traits.OpTraits` (None: not known)

    def snapshot(self) -> tuple[int, int]:
        """(mem_bytes, rng_bytes) so far."""
        return self.mem_bytes, self.rng_bytes

    def tally(
        self, func: Any, args: tuple, kwargs: dict, out: Any, outs: list, flops: int, inputs: set | None = None,
        local: "WorkTally | None" = None, out_keys: list | None = None, traits: Any = None,
    ) -> None:
        """Count one op: `outs` its tensor outputs, `flops` what the FLOP counter gave it;
        `inputs`, when known, the storage keys of its tensor arguments, and `out_keys` those of `outs`.
        `local`: the work the op did on this rank's local tensors (a DTensor op, `tp_work.LocalWork`),
        counted instead. `traits`: the op's `op_traits.OpTraits`, when the caller has them."""
        first = outs[0] if outs else None
        mem = rng = 0
        if local is not None:
            mem, rng = local.mem_bytes, local.rng_bytes
            self.mem_bytes += mem
            self.rng_bytes += rng
            self.comm_bytes += local.comm_bytes
            self.flop_dtypes.update(local.flop_dtypes)
            self.mem_dtypes.update(local.mem_dtypes)
        elif traits.collective if traits is not None else _is_collective(func):
            self.comm_bytes += collective_bytes(func, args, kwargs, outs)
        elif flops:
            if first is not None:
                self.flop_dtypes[(_device_name(first.device), first.dtype)] += flops
        else:
            kind = _UNSEEN if traits is None else traits.write_kind
            nbytes = written_bytes(func, args, kwargs, out, inputs, outs, out_keys, kind)
            if nbytes:
                if traits.random if traits is not None else is_random(func):
                    rng = nbytes
                    self.rng_bytes += nbytes
                else:
                    mem = nbytes
                    self.mem_bytes += nbytes
                if first is not None and first.is_floating_point():
                    self.mem_dtypes[(_device_name(first.device), first.dtype)] += nbytes
        if self.on_op is not None:
            self.op_keys = (inputs, out_keys)
            self.op_traits = traits
            self.on_op(func, args, kwargs, outs, flops, mem, rng)

    def dominant(self) -> dict[str, str]:
        """Device and dtypes that carried most of the FLOPs and of the bytes (strings, for meta)."""
        flop = self.flop_dtypes.most_common(1)
        mem = self.mem_dtypes.most_common(1)
        device = (flop or mem or [(("cpu", torch.float32), 0)])[0][0][0]
        flop_dtype = flop[0][0][1] if flop else (mem[0][0][1] if mem else torch.float32)
        mem_dtype = mem[0][0][1] if mem else flop_dtype
        return {"device": device, "flop_dtype": str(flop_dtype), "mem_dtype": str(mem_dtype)}


class OpBytesCounter(TorchDispatchMode, WorkTally):
    """Counts bytes written by ops that `flops` counts 0 FLOPs for; enter it after `flops`.

    Stacked above the FLOP counter, an op is seen once, before the counter decomposes it,
    and the counter's total before and after the op says whether it had FLOPs. A probe
    uses `probe_counters.ProbeCounters`, which does this and the FLOP count in one mode.
    """

    def __init__(self, flops: FlopCounterMode) -> None:
        super().__init__()
        self.flops = flops
        self._init_tally()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self.flops.get_total_flops()
        out = func(*args, **kwargs)
        self.tally(func, args, kwargs, out, flat_tensors(out), self.flops.get_total_flops() - before)
        return out
