"""Which module state a forward writes: buffers and tensor attributes written in place, resized or rebound.

A slot is one named place of a module that holds a tensor: a buffer (`_buffers[name]`) or a plain
tensor attribute (`__dict__[name]`, e.g. the weight `torch.nn.utils.spectral_norm` sets each forward).
`fingerprint` records, before a forward, each slot's object, version, shape and a copy of its values
(some kernels write in place without moving the version, BatchNorm's running statistics among them);
`written_slots` compares them after it. Parameters are not slots: the optimizer, not the forward, writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = [
    "Slot", "WrittenStateWatch", "fingerprint", "get_slot", "set_slot", "slot_bytes", "slot_modules", "state_slots",
    "written_slots",
]

BUFFER = "buffer"
ATTRIBUTE = "attribute"


@dataclass(frozen=True, eq=False)
class Slot:
    """One tensor-holding place of a module. `inplace`: the forward writes the tensor itself (its
    version or shape moves), so a snapshot must copy it; otherwise it only rebinds the name."""

    module: nn.Module
    kind: str
    name: str
    inplace: bool = True

    @property
    def key(self) -> tuple[int, str, str]:
        return (id(self.module), self.kind, self.name)


def slot_modules(blocks: Iterable[nn.Module]) -> list[nn.Module]:
    """Every module under `blocks`, each once, in order."""
    seen: dict[int, nn.Module] = {}
    for blk in blocks:
        for m in blk.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


def state_slots(modules: Iterable[nn.Module]) -> list[Slot]:
    """The buffers and plain tensor attributes of `modules` that hold a tensor now."""
    return [Slot(m, kind, name) for m, kind, name in _places(modules)]


def _places(modules: Iterable[nn.Module]) -> Iterator[tuple[nn.Module, str, str]]:
    """(module, kind, name) of each slot `state_slots` finds, in its order."""
    for m in modules:
        for name, buf in m._buffers.items():
            if buf is not None:
                yield m, BUFFER, name
        for name, value in vars(m).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield m, ATTRIBUTE, name


def get_slot(slot: Slot) -> torch.Tensor | None:
    """The tensor in `slot` now, or None when the slot is empty."""
    table = slot.module._buffers if slot.kind == BUFFER else vars(slot.module)
    value = table.get(slot.name)
    return value if isinstance(value, torch.Tensor) else None


def set_slot(slot: Slot, value: torch.Tensor | None) -> None:
    """Put `value` (the same object, not a copy) in `slot`; None empties it."""
    table = slot.module._buffers if slot.kind == BUFFER else vars(slot.module)
    if value is None:
        table.pop(slot.name, None)
    else:
        table[slot.name] = value


Fingerprint = dict[tuple[int, str, str], tuple[Slot, Any, int, tuple[int, ...], Any]]


def fingerprint(slots: Iterable[Slot]) -> Fingerprint:
    """Each slot's object (held, so its id cannot be reused), version, shape and a copy of its
    values (one copy per object), by slot key."""
    out = {}
    copies: dict[int, torch.Tensor] = {}
    for s in slots:
        t = get_slot(s)
        if t is None:
            out[s.key] = (s, None, -1, (), None)
            continue
        if id(t) not in copies:
            copies[id(t)] = t.detach().clone()
        out[s.key] = (s, t, t._version, tuple(t.shape), copies[id(t)])
    return out


def _same_values(copy: torch.Tensor, now: torch.Tensor) -> bool:
    if copy.shape != now.shape or copy.dtype != now.dtype or copy.device != now.device:
        return False
    try:
        return bool(torch.equal(copy, now.detach()))
    except RuntimeError:  # a layout without equality: count it as written
        return False


def written_slots(before: Fingerprint, modules: Iterable[nn.Module]) -> list[Slot]:
    """The slots a forward wrote, from the `fingerprint` taken before it: the tensor written in place
    or resized (`inplace=True`), rebound to another object (`inplace=False`), or created or removed."""
    out = []
    # created by the forward: before it, the slot was empty (each key once, as slots are found)
    created = {(id(m), kind, name): (m, kind, name) for m, kind, name in _places(modules)}
    for key, (slot, obj, version, shape, copy) in before.items():
        now = get_slot(slot)
        moved = obj is not None and (
            obj._version != version or tuple(obj.shape) != shape or not _same_values(copy, obj)
        )
        if moved or now is not obj:
            out.append(Slot(slot.module, slot.kind, slot.name, inplace=moved))
    for key, (m, kind, name) in created.items():
        if key not in before:
            out.append(Slot(m, kind, name, inplace=False))
    return out


def slot_bytes(slots: Iterable[Slot]) -> int:
    """Bytes of the tensors in `slots` now, each storage once: what a snapshot of them holds."""
    seen: set[int] = set()
    total = 0
    for s in slots:
        t = get_slot(s)
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _modes_off(tensors: list[torch.Tensor | None]) -> Any:
    """Every dispatch mode off for the copies and comparisons of `tensors`. Plain tensors skip Python
    dispatch altogether (a fraction of the cost of taking the modes off their stack and back); a
    tensor subclass (a DTensor buffer) keeps its own dispatch, with the modes taken off."""
    if all(type(t) is torch.Tensor or t is None for t in tensors):
        return torch._C._DisableTorchDispatch()
    return _disable_current_modes()


class WrittenStateWatch:
    """The state each block's forward writes, during a profiled step: `before(i, block)` as block i's
    forward starts (its first pre-hook), `after(i)` as it ends. `bytes[i]` and `names[i]` then hold
    the bytes a snapshot of it takes (`slot_bytes`) and the slots, as "path.name" under the block.
    The copies it compares with are made with every dispatch mode off, so no profiler counts them."""

    def __init__(self, n_blocks: int) -> None:
        self.bytes = [0] * n_blocks
        self.names: list[tuple[str, ...]] = [()] * n_blocks
        self._open: dict[int, tuple[nn.Module, list[nn.Module], Fingerprint]] = {}

    def before(self, i: int, block: nn.Module) -> None:
        modules = slot_modules([block])
        slots = state_slots(modules)  # (reads module tables only: no op runs)
        if not slots:  # nothing to copy: the modes need not be left
            self._open[i] = (block, modules, {})
            return
        with _modes_off([get_slot(s) for s in slots]), torch.no_grad():
            self._open[i] = (block, modules, fingerprint(slots))

    def after(self, i: int) -> None:
        if i not in self._open:
            return
        block, modules, before = self._open.pop(i)
        if before:
            with _modes_off([entry[1] for entry in before.values()]), torch.no_grad():
                written = written_slots(before, modules)
        else:  # no slot to compare (no op runs): only slots the forward created
            written = written_slots(before, modules)
        self.bytes[i] = max(self.bytes[i], slot_bytes(written))
        if not written:
            return
        paths = {id(m): p for p, m in block.named_modules()}
        found = (f"{paths[id(s.module)]}.{s.name}".lstrip(".") for s in written)
        self.names[i] = tuple(sorted({*self.names[i], *found}))
