"""The call sequence of one training step's forward: every module call in the order it starts, the
call it runs inside, whether autograd was on when it was made, whether its output needs a gradient,
and the activation bytes its ops save for backward (charged to the innermost running call). Calls are
named by the module's dotted path, with `#k` for the k-th grad-enabled call of a module called more than
once (`#nogradk` for its k-th call with autograd off).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.structure.batch import tensors_in
from lightning_ckpt.profiling.structure.blocks import plain_name
from lightning_ckpt.profiling.forward_state.state import preserved_state
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker, storage_bytes, storage_key

__all__ = ["CallSequence", "ModuleCall", "record_calls"]


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module of the model. parent: the index of the call it ran inside (-1: none).
    index: its place among the module's grad-enabled calls (among its calls with autograd off, for
    one made with autograd off). own_saved_bytes: what its own ops saved; saved_bytes: with the calls inside it."""

    module: nn.Module
    path: str
    name: str
    index: int
    parent: int
    grad_enabled: bool
    output_requires_grad: bool
    own_saved_bytes: int
    saved_bytes: int


@dataclass(frozen=True)
class CallSequence:
    """The calls in the order they started (a call's parent comes before it). outside_saved_bytes:
    saved while no module of the model ran (the loss after the model's forward, say)."""

    calls: tuple[ModuleCall, ...]
    outside_saved_bytes: int

    @property
    def step_saved_bytes(self) -> int:
        return self.outside_saved_bytes + sum(c.own_saved_bytes for c in self.calls)

    def called(self) -> set[nn.Module]:
        return {c.module for c in self.calls}


def _no_backward(_: Any) -> None:
    raise RuntimeError("discover_chain runs a forward only; its graph has no saved tensors to run backward on")


class _Recorder:
    """Module hooks and a saved-tensor hook over one forward. Saved storages are counted once each,
    leaving out the parameters and the batch (`skip_keys`)."""

    def __init__(self, model: nn.Module, skip_keys: set) -> None:
        self.calls: list[list] = []  # [module, parent, grad_enabled, output_requires_grad, own bytes]
        self.stack: list[int] = []
        self.outside = 0
        self.seen: set = set(skip_keys)
        self.watched: list = []  # weak references to the saved storages, each dropping its key when it dies
        self.skip_ids = {id(p) for p in model.parameters()}

    def pre(self, module: nn.Module, args: Any) -> None:
        parent = self.stack[-1] if self.stack else -1
        self.stack.append(len(self.calls))
        self.calls.append([module, parent, torch.is_grad_enabled(), False, 0])

    def post(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.stack and self.calls[self.stack[-1]][0] is module:
            call = self.calls[self.stack.pop()]
            call[3] = any(t.requires_grad for t in tensors_in(out))

    def pack(self, t: torch.Tensor):
        key = storage_key(t)
        base = t if t._base is None else t._base
        if key is not None and key not in self.seen and id(base) not in self.skip_ids:
            self.seen.add(key)
            if self.stack:
                self.calls[self.stack[-1]][4] += storage_bytes(t)
            else:
                self.outside += storage_bytes(t)
            # Nothing holds the storage: the forward holds no more than its tensors still in use (a
            # node holding its own output as a Python object, what returning `t` stores, would also
            # be a cycle through the autograd graph that is never freed: no backward runs). When it
            # dies its key is forgotten, so that a new storage at its address counts as new.
            self.watched.append(weakref.ref(t.untyped_storage(), lambda _ref, key=key: self.seen.discard(key)))
        return None


def record_calls(model: nn.Module, step_fn: Callable[[Any], Any], batch: Any, limit_bytes: int | None = None) -> CallSequence:
    """Run `step_fn(batch)` (a forward, no backward) with every module of `model` hooked; all state
    is left as found. The batch's and the parameters' storages are not counted as saved. With
    `limit_bytes`, the forward is stopped by `LiveBytesOverLimit` before the tensors it makes hold more."""
    keys = {storage_key(p) for p in model.parameters()} | {storage_key(t) for t in tensors_in(batch)}
    rec = _Recorder(model, keys - {None})
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(rec.pre))
        handles.append(m.register_forward_hook(rec.post, always_call=True))
    tracker = LiveBytesTracker()
    tracker.limit_bytes = limit_bytes
    try:
        with preserved_state(model), torch.autograd.graph.saved_tensors_hooks(rec.pack, _no_backward):
            with tracker if limit_bytes is not None else contextlib.nullcontext():
                step_fn(batch)
    finally:
        for h in handles:
            h.remove()
    return _sequence(model, rec.calls, rec.outside)


def _sequence(model: nn.Module, raw: list[list], outside: int) -> CallSequence:
    paths = {m: plain_name(n) for n, m in model.named_modules()}
    total = [c[4] for c in raw]
    for i in range(len(raw) - 1, -1, -1):  # children start after their parent
        if raw[i][1] >= 0:
            total[raw[i][1]] += total[i]
    counts = Counter((c[0], c[2]) for c in raw)
    seen: Counter = Counter()
    calls = []
    for i, (module, parent, grad, out_grad, own) in enumerate(raw):
        k = seen[(module, grad)]
        seen[(module, grad)] += 1
        path = paths.get(module, type(module).__name__)
        if grad:
            name = f"{path}#{k}" if counts[(module, True)] > 1 else path
        else:  # only in a chain none of whose blocks runs with autograd on (`discovery`)
            name = f"{path}#nograd{k}" if counts[(module, True)] + counts[(module, False)] > 1 else path
        calls.append(ModuleCall(module, path, name, k, parent, grad, out_grad, own, total[i]))
    return CallSequence(tuple(calls), outside)
