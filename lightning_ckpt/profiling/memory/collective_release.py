"""A functional collective under a live-bytes tracker, waited for where it is issued: c10d runs it on a
thread of its own (gloo's workers) whose work holds its tensors until that thread drops it, so a storage
the step let go of could be freed there, later and by a varying number of ops (a tensor-parallel step's
profile and measured peak moved by whole activations). `call_op` waits until that thread let go.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["RELEASE_TIMEOUT_S", "call_op", "is_issued_collective"]

_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")  # torch's functional collectives
# past this the collective's thread is left to let go when it does (a floor misjudged); the wait ends as soon as it
# lets go (well under a millisecond here), and on a loaded machine its thread may wait long for a core
RELEASE_TIMEOUT_S = 2.0
_POLL_S = 1e-5


_ISSUED: dict[Any, bool] = {}  # op overload -> `is_issued_collective` (its namespace and schema never change)


def is_issued_collective(func: Any) -> bool:
    """Whether op `func` issues a functional collective (not the wait for one)."""
    found = _ISSUED.get(func)
    if found is None:
        found = _ISSUED[func] = _issues_collective(func)
    return found


def _issues_collective(func: Any) -> bool:
    if getattr(func, "namespace", None) not in _NAMESPACES:
        return False
    schema = getattr(func, "_schema", None)
    return schema is not None and not schema.name.endswith(("::wait_tensor", "::_wrap_tensor_autograd"))


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """(references to tensor `t`, references to its storage: its tensors and views, and the one
    this call makes); (0, 0) for a tensor without a storage of its own (nothing to wait on)."""
    try:
        return int(t._use_count()), int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError, NotImplementedError):
        return 0, 0


def _held(t: torch.Tensor, floor: tuple[int, int]) -> bool:
    tensor, storage = _holders(t)
    return tensor > floor[0] or storage > floor[1]


def call_op(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """`func(*args, **kwargs)`. A functional collective on CPU tensors is also waited for
    (`wait_tensor`; the step's own wait then finds it done) and its tensors held until the
    collective's thread dropped its references to them, or `RELEASE_TIMEOUT_S` passed."""
    kwargs = kwargs or {}
    if not is_issued_collective(func):
        return func(*args, **kwargs)
    inputs = _tensors((args, kwargs))
    floors = {id(t): _holders(t) for t in inputs}  # what holds them before the collective does
    out = func(*args, **kwargs)
    outs = _tensors(out)
    if not outs or any(t.device.type != "cpu" for t in outs + inputs):
        return out  # (NCCL's work is released by its watchdog, at its own pace: left as it is)
    for t in outs:
        torch.ops._c10d_functional.wait_tensor(t)
    # a new output is held by the result alone (its storage also by the count's own reference), an input
    # by what held it before; the collective's thread holds them (and views on them) until it is done
    watched = [(t, floors.get(id(t), (1, 2))) for t in outs] + [(t, floors[id(t)]) for t in inputs]
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while any(_held(t, floor) for t, floor in watched) and time.monotonic() < deadline:
        time.sleep(_POLL_S)  # the collective's thread drops its work (and with it the tensors) now
    return out
