"""What a probe reads off an op overload, read once per overload (`traits_of`).

The probe's dispatch mode asks the same questions of every op it sees (a metadata query? does it
write, draw random numbers, run a collective? its FLOP formula, its name for selective checkpointing,
the arguments it writes in place). Their answers never change for an overload, and a dict of its own
for each hashed the overload (a Python-level hash) about ten times per op: `OpTraits` holds them all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, shape_wrapper

from lightning_ckpt.profiling.memory.collective_release import is_issued_collective
from lightning_ckpt.profiling.work.op_bytes import is_random, write_kind
from lightning_ckpt.profiling.work.op_keys import counted, op_name
from lightning_ckpt.profiling.work.op_profile import written_args
from lightning_ckpt.profiling.work.tp_work import is_collective

__all__ = ["QUERIES", "OpTraits", "traits_of"]

_aten = torch.ops.aten
# metadata queries that torch's FLOP counter leaves to tensor subclasses (nested tensors)
QUERIES = frozenset({
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
})

_SHAPE_WRAPPED = shape_wrapper(lambda: 0).__code__  # torch's formulas take shapes, mapped by that wrapper
_CIA = torch._C.DispatchKey.CompositeImplicitAutograd


class OpTraits:
    """The answers for one op overload `func` (plain attributes, read on every op)."""

    __slots__ = (
        "collective", "counted", "cia", "formula", "func", "is_view", "issued", "name", "query", "random",
        "shape_formula", "write_kind", "written_args",
    )

    def __init__(self, func: Any) -> None:
        self.func = func  # held: the overload outlives its entry, so its identity is never reused
        self.query = func in QUERIES
        self.write_kind = write_kind(func)  # `op_bytes.written_bytes`
        self.random = is_random(func)
        self.collective = is_collective(func)  # `tp_work`: counted as bytes moved
        self.issued = is_issued_collective(func)  # `collective_release`: waited for where issued
        self.counted = counted(func)  # numbered by selective checkpointing (`op_keys`)
        self.name = op_name(func) if self.counted else None
        self.is_view = bool(getattr(func, "is_view", False))
        self.written_args = written_args(func)
        self.cia: bool | None = None  # a C++ CompositeImplicitAutograd kernel (read when first asked)
        packet = getattr(func, "_overloadpacket", None)
        self.formula = flop_registry.get(packet) if packet is not None else None  # torch's FLOP formula
        inner = getattr(self.formula, "__wrapped__", None)
        # the formula on shapes, when torch's wrapper only maps tensors to their shapes
        self.shape_formula = inner if getattr(self.formula, "__code__", None) is _SHAPE_WRAPPED else None

    def decomposes(self) -> bool:
        """Whether `func.decompose` may run a decomposition (what it checks first, in torch/_ops.py): an op
        without one returns NotImplemented there. A Python kernel is looked for now (it may be registered later)."""
        try:
            if _CIA in self.func.py_kernels:
                return True
            if self.cia is None:
                self.cia = bool(torch._C._dispatch_has_kernel_for_dispatch_key(self.func.name(), _CIA))
            return self.cia
        except AttributeError:  # not an op overload: let `decompose` say
            return True


_BY_ID: dict[int, OpTraits] = {}  # id(overload) -> its traits (an identity lookup: no Python-level hash)
_registry_size = -1  # len(flop_registry) when the traits were read: a formula registered since clears them


def traits_of(func: Any) -> OpTraits:
    """The `OpTraits` of op overload `func` (read on its first call, and again after a FLOP formula is registered)."""
    global _registry_size
    found = _BY_ID.get(id(func))
    if found is not None and found.func is func and _registry_size == len(flop_registry):
        return found
    if _registry_size != len(flop_registry):
        _BY_ID.clear()
        _registry_size = len(flop_registry)
    found = _BY_ID[id(func)] = OpTraits(func)
    return found
