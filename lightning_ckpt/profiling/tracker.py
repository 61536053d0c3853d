"""Deterministic measurement of live tensor bytes.

`LiveBytesTracker` is a `TorchDispatchMode` that sees every tensor an op creates,
counts each storage once while it is alive (a weak-reference finalizer drops it
when freed) and keeps a running peak. It is exact and repeatable on CPU, unlike
RSS. `measure_peak` wraps one callable; on CUDA `cuda_peak` reads the allocator.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytesTracker", "flat_tensors", "local_tensor", "storage_bytes", "storage_key", "unique_storage_bytes"]


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, through tuples, lists and dicts: what an op takes and returns.

    Dispatch modes see every op, so this stands in for `torch.utils._pytree.tree_flatten` on
    their hot path, which also looks for every registered container type: op arguments and
    results hold no other containers.
    """
    if isinstance(value, torch.Tensor):
        return [value]
    out: list[torch.Tensor] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding `t`'s bytes on this process: a DTensor's local shard, else `t` itself."""
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2, tensor parallel)
    return local if isinstance(local, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, data pointer) of the storage behind `t`; None for meta, empty or storage-less tensors
    (a storage FSDP2 freed by resizing it to 0 bytes, a wrapper subclass without data)."""
    try:
        st = local_tensor(t).untyped_storage()
        if st.device.type == "meta" or st.nbytes() == 0:
            return None
        return (str(st.device), st.data_ptr())
    except (RuntimeError, NotImplementedError):  # meta, sparse, functional wrappers, invalid python storage
        return None


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind `t` (a view counts its whole base; a DTensor its local shard)."""
    try:
        return int(local_tensor(t).untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return 0


def unique_storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages among `tensors` (non-tensors are skipped)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += storage_bytes(t)
    return total


class LiveBytesTracker(TorchDispatchMode):
    """Counts bytes of storages created by ops while the mode is active.

    `live_bytes` is what is alive now, `peak_bytes` the most seen since the last
    `reset_peak()`. Storages that existed before the mode (parameters, the batch)
    are not counted: add a baseline yourself (`unique_storage_bytes`) when you
    want the whole picture. `device` limits counting to one device type. A `ledger`
    (`lifetimes.StorageLedger`) is told of every storage made, read and freed.
    """

    def __init__(self, device: str | None = None, ledger: Any = None) -> None:
        super().__init__()
        self.device = device
        self.ledger = ledger
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[tuple[str, int], int] = {}
        self._finalizers: list[weakref.finalize] = []

    def adopt(self, tensors: Iterable[Any]) -> None:
        """Count storages that already exist (parameters, gradients, optimizer state).

        They join `live_bytes` now and leave it when freed, so a step that drops
        last step's gradients (`zero_grad(set_to_none=True)`) is measured right.
        """
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def is_live(self, key: tuple[str, int] | None) -> bool:
        """Whether the storage with this `storage_key` is counted in `live_bytes` now."""
        return key in self._live

    def _free(self, key: tuple[str, int]) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.live_bytes -= nbytes
            if self.ledger is not None:
                self.ledger.freed(key)

    def _track(self, t: torch.Tensor) -> None:
        if self.device is not None and t.device.type != self.device:
            return
        key = storage_key(t)
        if key is None or key in self._live:
            return
        st = local_tensor(t).untyped_storage()
        nbytes = int(st.nbytes())
        self._live[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.ledger is not None:
            self.ledger.born(key, nbytes)
        self._finalizers.append(weakref.finalize(st, self._free, key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: that storage was either
        # counted when it was made or existed before the mode (a parameter): skip it.
        inputs = {storage_key(t) for t in flat_tensors((args, kwargs))}
        if self.ledger is not None:
            self.ledger.used(inputs)
        for t in flat_tensors(out):
            if storage_key(t) not in inputs:
                self._track(t)
        return out

    def __exit__(self, *exc) -> Any:
        result = super().__exit__(*exc)
        # Storages that outlive the mode keep counting only until the mode is gone.
        for fin in self._finalizers:
            fin.detach()
        self._finalizers.clear()
        return result
