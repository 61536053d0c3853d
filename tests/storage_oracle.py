"""A count of live tensor bytes written apart from the library's tracker (`profiling.memory.tracker`), to check
its predictions against: a dispatch mode that adds each storage an op returns, once, and drops it when the
storage is freed (a weak reference to the storage, which torch keeps as long as its memory lives). What
existed before is added by hand (`count`: parameters, gradients, optimizer state, the batch). No flat-tensor
walk, no storage keys, no schema reading of the library's are used: only torch's pytree and storages.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorages(TorchDispatchMode):
    """`bytes` of the storages alive now, `peak` the most since entering (or since `count`)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[tuple[str, int], int] = {}
        self.bytes = self.peak = 0
        self._refs: list[weakref.ref] = []

    def count(self, tensors: Iterable[Any]) -> None:
        """Add storages that exist already; the peak starts from them."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = self.bytes

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = (str(t.device), storage.data_ptr())
        if nbytes == 0 or key in self.live:
            return
        self.live[key] = nbytes
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)
        self._refs.append(weakref.ref(storage, lambda _ref, key=key: self._drop(key)))

    def _drop(self, key: tuple[str, int]) -> None:
        self.bytes -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        self._refs.clear()  # storages freed later change nothing
        return result


def step_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """What a training step finds alive: parameters, buffers, gradients and optimizer state."""
    params = list(model.parameters())
    out = params + list(model.buffers()) + [p.grad for p in params if p.grad is not None]
    if optimizer is not None:
        out += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


class StorageWindow(TorchDispatchMode):
    """Every storage born while open, and what of it is alive at any later moment: a storage is born in the op
    that returns it first (a result on one of the op's inputs' storages is not a birth: views, in-place ops)
    and dies when torch frees it (a weak reference's callback). Storages that existed before opening count
    only when given to `count` (the parameters, say), so what is alive at a moment is what was made since
    the window opened and never freed, plus those. `snapshot()` lists the alive ones with their sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}  # data pointer -> (bytes, the op that made it)
        self._refs: dict[int, weakref.ref] = {}
        self.born_bytes = 0
        self.now_bytes = self.peak_bytes = 0

    def reset_peak(self) -> None:
        """The peak starts again from what is alive now."""
        self.peak_bytes = self.now_bytes

    def count(self, tensors: Iterable[Any], made_by: str = "before") -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), made_by)

    def _add(self, storage: torch.UntypedStorage, made_by: str) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr == 0 or nbytes == 0 or ptr in self.live:
            return
        self.live[ptr] = (nbytes, made_by)
        self.born_bytes += nbytes
        self.now_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.now_bytes)
        self._refs[ptr] = weakref.ref(storage, lambda _ref, ptr=ptr: self._gone(ptr))

    def _gone(self, ptr: int) -> None:
        nbytes, _ = self.live.pop(ptr, (0, ""))
        self.now_bytes -= nbytes
        self._refs.pop(ptr, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in given:
                    self._add(storage, str(func))
        return out

    def alive_bytes(self) -> int:
        return self.now_bytes

    def snapshot(self) -> dict[int, tuple[int, str]]:
        return dict(self.live)

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        self._refs.clear()  # storages freed later change nothing
        return result


def distinct_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages of `tensors` (their own sizes; each storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
