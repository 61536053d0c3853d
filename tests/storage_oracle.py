"""A count of live tensor bytes written apart from the library's tracker (`profiling.tracker`), to check
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
