"""Recompute a checkpointed region against the module state its original forward saw.

Some modules write state in their forward and compute with it: BatchNorm's running statistics,
spectral norm's power-iteration vectors, QAT observers and fake-quantize parameters, counters,
buffers rebound to a new tensor. A recompute that ran on the state the forward left would compute
other values and advance the state a second time. `StateGuard` finds once (per train/eval mode of
the region's modules) which slots (`profiling.forward_state.written_state`) the region's forward writes, copies
them at each opening of the region, and runs each recompute on a fresh copy of that pre-forward
state; afterwards the slots get back the very objects the forward left, untouched. A region whose
forward writes nothing pays nothing but the check of its modules' modes at each opening.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.forward_state.written_state import (
    Slot,
    fingerprint,
    get_slot,
    set_slot,
    slot_modules,
    state_slots,
    written_slots,
)

__all__ = ["StateGuard", "StateRestore", "Stacked"]


class _Snapshot:
    """The pre-forward content of some slots: a copy of each tensor written in place (one copy per
    object, so slots sharing a tensor share it again), the object itself for a slot only rebound,
    None for a slot that was empty."""

    def __init__(self, slots: Sequence[Slot], copies: dict[int, torch.Tensor] | None = None) -> None:
        copies = {} if copies is None else copies
        self.entries: list[tuple[Slot, torch.Tensor | None]] = []
        for s in slots:
            t = get_slot(s)
            if t is not None and s.inplace:
                if id(t) not in copies:
                    copies[id(t)] = t.detach().clone()
                t = copies[id(t)]
            self.entries.append((s, t))


class StateRestore:
    """Recompute context of one opening of a region: each recompute (there may be several, and
    they may nest) runs on fresh copies of the snapshot; on exit every slot holds again the object
    it held on entry, whose values the recompute never touched."""

    def __init__(self, snapshot: _Snapshot) -> None:
        self.snapshot = snapshot
        self._frames: list[list[tuple[Slot, torch.Tensor | None]]] = []
        self._versions: list[list[tuple[Slot, torch.Tensor, int]]] = []

    def __enter__(self) -> StateRestore:
        frame: list[tuple[Slot, torch.Tensor | None]] = []
        fresh: dict[int, torch.Tensor] = {}
        try:
            for slot, saved in self.snapshot.entries:
                frame.append((slot, get_slot(slot)))
                if saved is not None:
                    if id(saved) not in fresh:
                        fresh[id(saved)] = saved.detach().clone()
                    saved = fresh[id(saved)]
                set_slot(slot, saved)
        except BaseException:
            _put_back(frame)
            raise
        self._frames.append(frame)
        self._versions.append([(s, t, t._version) for s, t in frame if t is not None])
        return self

    def __exit__(self, *exc: Any) -> None:
        _put_back(self._frames.pop())
        moved = [s for s, t, version in self._versions.pop() if t._version != version]
        if moved:
            names = ", ".join(f"{type(s.module).__name__}.{s.name}" for s in moved)
            warnings.warn(
                f"lightning-ckpt: a recompute wrote the module state {names} through another reference than the "
                "module's own attribute, so it now differs from what the forward left. Keep that block out of the "
                "plan, or write the state through the module attribute.",
                stacklevel=2,
            )


def _put_back(frame: list[tuple[Slot, torch.Tensor | None]]) -> None:
    for slot, obj in reversed(frame):
        set_slot(slot, obj)


class _Detect:
    """Forward context of a region's first opening in a mode: on a completed forward, records
    which slots it wrote and trims the opening's snapshot to them."""

    def __init__(self, guard: StateGuard, mode: tuple[bool, ...], before: dict, snapshot: _Snapshot) -> None:
        self.guard, self.mode, self.before, self.snapshot = guard, mode, before, snapshot

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        before, self.before = self.before, {}
        if exc_type is not None:
            self.snapshot.entries = []  # the forward failed: no backward will recompute it
            return
        written = written_slots(before, self.guard.modules)
        self.guard.written[self.mode] = tuple(written)
        # a slot the forward created was empty before it: no entry, so None
        taken = {s.key: t for s, t in self.snapshot.entries}
        self.snapshot.entries = [(s, taken.get(s.key)) for s in written]


class StateGuard:
    """The written state of one checkpointed region (blocks `blocks`), kept across its forwards.

    `written` maps the train/eval modes of the region's modules to the slots its forward writes
    in those modes (found at the first forward in each mode). `contexts()` gives the (forward,
    recompute) contexts of one opening of the region, taking the snapshot of its written slots now.
    """

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self.modules = slot_modules(blocks)
        self.written: dict[tuple[bool, ...], tuple[Slot, ...]] = {}

    def contexts(self) -> tuple[Any, Any]:
        mode = tuple(m.training for m in self.modules)
        known = self.written.get(mode)
        if known is None:
            slots = state_slots(self.modules)
            before = fingerprint(slots)  # every slot copied once: which ones the forward writes is not known yet
            copies = {id(obj): copy for _, obj, _, _, copy in before.values() if obj is not None}
            snapshot = _Snapshot(slots, copies)
            return _Detect(self, mode, before, snapshot), StateRestore(snapshot)
        if not known:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), StateRestore(_Snapshot(known))

    def written_slots(self) -> tuple[Slot, ...]:
        """The slots written in the modes the modules are in now (empty until a forward ran in them)."""
        return self.written.get(tuple(m.training for m in self.modules), ())


class Stacked:
    """Several contexts entered in order and left in reverse, as one."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = contexts
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        with stack:
            for c in self.contexts:
                stack.enter_context(c)
            self._stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> bool:
        stack, self._stack = self._stack, None
        return bool(stack.__exit__(*exc)) if stack is not None else False

