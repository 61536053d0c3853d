"""Find the chain to plan over from the bytes one training step saves, when no blocks are named.

One forward of the step on a small slice of the batch records, per module, how often it runs,
when it first runs and the activation bytes its ops save for backward. The chain is read off the
model's *call sequence*: the modules in call order, with every `nn.ModuleList` and
`nn.Sequential` of one class (a container) replaced by its children, and every module that
holds a container deeper down, but none among its children, replaced by its own sequence
(the other children of a module with a container child, such as a U-Net's mid block, stay whole). The chain runs from the first child of a container to
the last one, across containers (a U-Net's down blocks, mid block and up blocks; both stacks of
an encoder-decoder) and takes every module in between that runs once. What it leaves out is
still in the memory model (`lifetimes`); `ChainChoice` says what it chose and what it left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.batch import batch_size_of, slice_batch, tensors_in
from lightning_ckpt.profiling.blocks import plain_name
from lightning_ckpt.profiling.state import preserved_state
from lightning_ckpt.profiling.tracker import storage_bytes, storage_key
from lightning_ckpt.units import format_bytes

__all__ = ["ChainChoice", "discover_chain"]


@dataclass(frozen=True)
class ChainChoice:
    """The chain `discover_chain` chose. Bytes are what the probed slice's forward saves.

    names, modules: the blocks in call order. covered_bytes: what the blocks save; step_bytes:
    what the whole step saves. left_out: (module, bytes) of the modules of the call sequence
    outside the chain that save something, and ("(outside any module)", bytes) for the rest.
    probe_batch_size: the slice it was measured on.
    """

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    covered_bytes: int
    step_bytes: int
    left_out: tuple[tuple[str, int], ...]
    probe_batch_size: int

    def __str__(self) -> str:
        share = self.covered_bytes / self.step_bytes if self.step_bytes else 1.0
        first, last = (self.names[0], self.names[-1]) if self.names else ("-", "-")
        rest = ", ".join(f"{n} {format_bytes(b)}" for n, b in self.left_out) or "nothing"
        return (
            f"blocks=None: chose {len(self.names)} blocks from {first} to {last}, which save "
            f"{format_bytes(self.covered_bytes)} of the {format_bytes(self.step_bytes)} the step saves "
            f"({100 * share:.1f}%) at batch {self.probe_batch_size}; left out: {rest}. They stay in the memory "
            "model; name blocks=[...] to plan over others."
        )

    def to_dict(self) -> dict:
        return {
            "names": list(self.names), "covered_bytes": self.covered_bytes, "step_bytes": self.step_bytes,
            "left_out": [list(x) for x in self.left_out], "probe_batch_size": self.probe_batch_size,
        }


def _is_container(module: nn.Module) -> bool:
    """A ModuleList, or a Sequential of children of one class (a Sequential of mixed layers is one
    module, such as an MLP, not a list of blocks)."""
    children = list(module.children())
    if isinstance(module, nn.ModuleList):
        return len(children) >= 2
    return isinstance(module, nn.Sequential) and len(children) >= 2 and len({type(c) for c in children}) == 1


def _no_backward(_: Any) -> None:
    raise RuntimeError("discover_chain runs a forward only; its graph has no saved tensors to run backward on")


class _Recorder:
    """Module hooks and a saved-tensor hook over one forward: calls, first-call order, and the
    unique saved storages charged to the innermost running module (and so to its ancestors)."""

    def __init__(self, model: nn.Module, skip_keys: set) -> None:
        self.calls: dict[nn.Module, int] = {}
        self.order: dict[nn.Module, int] = {}
        self.own: dict[nn.Module | None, int] = {}
        self.stack: list[nn.Module] = []
        self.seen: set = set(skip_keys)
        self.held: list = []  # the saved storages, alive while the forward runs
        self.skip_ids = {id(p) for p in model.parameters()}

    def pre(self, module, args) -> None:
        self.calls[module] = self.calls.get(module, 0) + 1
        self.order.setdefault(module, len(self.order))
        self.stack.append(module)

    def post(self, module, args, out) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    def pack(self, t: torch.Tensor):
        key = storage_key(t)
        base = t if t._base is None else t._base
        if key is not None and key not in self.seen and id(base) not in self.skip_ids:
            self.seen.add(key)
            owner = self.stack[-1] if self.stack else None
            self.own[owner] = self.own.get(owner, 0) + storage_bytes(t)
        # the storage is held until the recorder goes (so that its address is not reused and counted
        # as seen), the tensor is not: a node holding its own output as a Python object (what returning
        # `t` stores) is a cycle through the autograd graph that is never freed; no backward runs
        self.held.append(t.untyped_storage())
        return None


def discover_chain(
    model: nn.Module, step_fn: Callable[[Any], torch.Tensor], batch: Any, probe_batch_size: int = 2
) -> ChainChoice:
    """The chain of `model` that covers most of the activation bytes `step_fn(batch)` saves
    (see the module docstring), measured on a slice of `probe_batch_size` samples. All state is
    left as found; no backward runs."""
    small = slice_batch(batch, min(probe_batch_size, batch_size_of(batch)))
    keys = {storage_key(p) for p in model.parameters()} | {storage_key(t) for t in tensors_in(small)}
    rec = _Recorder(model, keys - {None})
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(rec.pre))
        handles.append(m.register_forward_hook(rec.post, always_call=True))
    try:
        with preserved_state(model), torch.autograd.graph.saved_tensors_hooks(rec.pack, _no_backward):
            step_fn(small)
    finally:
        for h in handles:
            h.remove()
    names = {m: plain_name(n) for n, m in model.named_modules()}
    inclusive: dict[nn.Module, int] = {}

    def total(m: nn.Module) -> int:
        if m not in inclusive:
            inclusive[m] = rec.own.get(m, 0) + sum(total(c) for c in m.children())
        return inclusive[m]

    holds = {}

    def has_container(m: nn.Module) -> bool:
        if m not in holds:
            holds[m] = any(_is_container(c) or has_container(c) for c in m.children())
        return holds[m]

    # [constraint] the call sequence: containers give their children, holders their own sequence
    sequence: list[tuple[nn.Module, bool]] = []  # (module, child of a container)

    first: dict[nn.Module, float] = {}

    def when(m: nn.Module) -> float:  # its first call, or its first descendant's (a ModuleList is never called)
        if m not in first:
            first[m] = rec.order.get(m, min((when(c) for c in m.children()), default=float("inf")))
        return first[m]

    def in_order(m: nn.Module) -> list[nn.Module]:
        return sorted((c for c in m.children() if when(c) < float("inf")), key=when)

    def expand(m: nn.Module) -> None:
        level = any(_is_container(c) for c in m.children())  # its other children sit between the containers
        for c in in_order(m):
            if _is_container(c):
                sequence.extend((g, True) for g in in_order(c))
            elif has_container(c) and not level:
                expand(c)
            else:
                sequence.append((c, False))

    expand(model)
    step = sum(rec.own.values())
    inside = [i for i, (_, boxed) in enumerate(sequence) if boxed]
    if not inside:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList (or nn.Sequential of one class) of two or more modules "
            "that run in the training step, so there is no chain to find. Pass blocks=[...] naming the modules to "
            "checkpoint, in call order."
        )
    lo, hi = inside[0], inside[-1]
    chosen = [m for m, _ in sequence[lo : hi + 1] if rec.calls.get(m) == 1]
    chosen_set = set(chosen)
    left = [(names[m], total(m)) for m, _ in sequence if m not in chosen_set and total(m) > 0]
    covered = sum(total(m) for m in chosen) + sum(total(m) for m, _ in sequence if m not in chosen_set)
    outside = step - covered
    if outside > 0:
        left.append(("(outside any module)", outside))
    return ChainChoice(
        names=tuple(names[m] for m in chosen),
        modules=tuple(chosen),
        covered_bytes=sum(total(m) for m in chosen),
        step_bytes=step,
        left_out=tuple(left),
        probe_batch_size=batch_size_of(small),
    )
