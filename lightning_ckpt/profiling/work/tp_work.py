"""Tensor-parallel work as one rank does it: which ops hold DTensors, and what a collective moves.

Under tensor parallelism a block's ops take DTensors. A dispatch mode sees each such op once with
the DTensors' global shapes; the rank runs it on its local shards, after redistributing them when
the op needs it. `probe_counters.LocalWork` counts that local work; this module says which ops it
applies to (`has_dtensor`) and sizes the functional collectives a forward runs (the all-reduce after
a row-wise layer, sequence parallelism's all-gather and reduce-scatter), which a recompute runs
again: `collective_bytes` as bytes of an all-gather output moving as much data per rank, the unit
of the measured all-gather rate (`gather.measure_gather_rate`).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_ckpt.profiling.memory.tracker import flat_tensors

__all__ = ["any_fake", "collective_bytes", "comm_bytes", "dtensor_in", "has_dtensor", "is_collective"]

# torch's functional collectives (DTensor redistribution, tensor-parallel layers); FSDP2 and DDP use
# c10d's in-place ones, which stay out of this count (their recompute gathers nothing more: `gather`)
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd")
# an all-reduce moves a reduce-scatter and an all-gather of its size (ring algorithms)
ALL_REDUCE_FACTOR = 2

try:  # torch built without distributed has no DTensor
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover
    _DTensor = None


def has_dtensor(values: Any) -> bool:
    """Whether `values` (an op's arguments, through tuples, lists and dicts) hold a DTensor."""
    if _DTensor is None:
        return False
    return dtensor_in(flat_tensors(values))


def dtensor_in(tensors: list[torch.Tensor]) -> bool:
    """Whether one of `tensors` (an op's, flattened once: `tracker.flat_tensors`) is a DTensor."""
    if _DTensor is None:
        return False
    for t in tensors:
        if isinstance(t, _DTensor):
            return True
    return False


def any_fake(values: Any) -> bool:
    """Whether `values` hold a fake or meta tensor (shape inference, which does no work on a device)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in flat_tensors(values))


def is_collective(func: Any) -> bool:
    """Whether op `func` is one of torch's functional collectives (`_c10d_functional`)."""
    return getattr(func, "namespace", None) in _FUNCTIONAL


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def collective_bytes(func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> int:
    """Bytes collective `func` moves, as the output of an all-gather that moves as much per rank:
    an all-gather or all-to-all its output, a reduce-scatter its input, an all-reduce twice its
    size, a broadcast its size; waits and autograd wrappers 0."""
    name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else str(func)
    if name.startswith(("wait", "_wrap")):
        return 0
    if "reduce_scatter" in name:
        inputs = flat_tensors(args[:1] if args else kwargs.get("input", kwargs.get("inputs")))
        return _nbytes(inputs)
    if "all_reduce" in name:
        return ALL_REDUCE_FACTOR * _nbytes(outs)
    return _nbytes(outs)


def comm_bytes(work: tuple[int, ...]) -> int:
    """The collective bytes of a (mem, rng, comm) work tally (`ProbeCounters.snapshot`); 0 without them."""
    return work[2] if len(work) > 2 else 0
