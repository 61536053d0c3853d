"""A profiling pass under checkpointing: it measures what the unplanned step holds while holding no more
than the `full` plan does.

Every tensor the step saves for backward is held in a `SavedBox` (the probe's saved-tensor hook makes one).
With `RecomputedSaves`, when a block's forward ends, the boxes of the tensors made in it let go of them,
as a checkpointed block keeps none of what it saves; when the backward first needs one, the block is
run again as a module call, on the arguments, RNG state and autocast state of its forward, unseen by
the probe's counters, and its saved tensors, in the order they were saved, stand in for the ones let go
(what torch's non-reentrant checkpoint does). The live-bytes tracker meanwhile counts each storage let go
as alive for exactly as long as the unplanned step would hold it (until its box dies with its node, or
the step lets go of it, whichever is later): a storage that dies while still counted is counted on
under a key of its own (`LiveBytesTracker.rename`), so that a new storage at its address is a new one.
Every field the probe measures is then the unplanned step's, while the memory really held (the tracker's
`held_bytes`: less what was let go, plus the block rebuilt) is what the tracker's limit bounds. A block
whose forward writes Python state a second run would repeat keeps its tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode, _pop_mode_temporarily

from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker, storage_bytes, storage_key

__all__ = ["RecomputeMismatch", "RecomputedSaves", "SavedBox"]

_AUTOCAST_DEVICES = ("cpu", "cuda")
_released_keys = itertools.count()


class RecomputeMismatch(RuntimeError):
    """A block run again saved other tensors than its forward did (another number, shape or dtype)."""


class SavedBox:
    """One tensor saved for backward, held by the probe (`tensor` None once let go). `block`, `index`:
    the block call it was saved in (None: outside every block) and its place among that call's saves."""

    __slots__ = ("tensor", "block", "index", "shape", "dtype", "hold", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, block: int | None, index: int, key: Any = None) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.key = key  # its storage when saved
        self.block, self.index = block, index
        self.shape, self.dtype = tensor.shape, tensor.dtype
        self.hold: _Hold | None = None


@dataclass(eq=False)
class _Hold:
    """A storage whose saved tensors were let go: how many boxes still stand for it, and whether the
    storage itself is gone (then the tracker counts it under `key`, a key of its own)."""

    key: Any
    boxes: int = 0
    gone: bool = False
    nbytes: int = 0


@dataclass(eq=False)
class _Call:
    """What a block call needs to run again as its forward did."""

    module: nn.Module
    args: tuple
    kwargs: dict
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    autocast: tuple
    held_keys: list


def _autocast_state() -> tuple:
    return tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
    )


class RecomputedSaves:
    """The saved tensors of one pass under checkpointing (see the module's docstring).

    `rename(key, new_key)`: the probe's own maps keyed by storage follow a storage counted on under a new
    key. `run_again(block, module, args, kwargs)`: calls the block as its forward did, with the probe's
    hooks quiet. `limit_bytes`: what the pass may hold (None: unbounded)."""

    def __init__(self, tracker: LiveBytesTracker, rename: Callable[[Any, Any], None],
                 run_again: Callable[[int, nn.Module, tuple, dict], Any]) -> None:
        self.tracker = tracker
        self._rename = rename
        self._run_again = run_again
        self.holds: dict[Any, _Hold] = {}  # storage key -> its hold, while the storage lives
        self.calls: dict[int, _Call] = {}
        self.boxes: dict[int, list[SavedBox]] = {}  # the boxes of the block call running now
        self.open: dict[int, int] = {}  # block -> its boxes let go and not dead yet
        self.rebuilt: dict[int, _Rebuilt] = {}
        self.watched: list[weakref.ref] = []  # the storages of rebuilt tensors
        self.recomputing = False
        self.blocks_let_go = 0
        self.held: dict[Any, int] = {}  # storage key -> how many held aliases of block arguments share it
        self.held_alias: dict[Any, torch.Tensor] = {}
        self.counted_dead: dict[Any, int] = {}  # held argument storages counted dead -> their bytes
        self.rebuilt_refs: dict[Any, int] = {}  # storage key of a held argument -> rebuilt tensors of it
        tracker.on_death = self._death
        tracker.before_op = self.look_for_deaths

    # -- the forward
    def enter(self, i: int, module: nn.Module, args: tuple, kwargs: dict | None) -> None:
        """Block call `i` starts: its arguments are held for a run again as aliases of their own (the
        caller's tensors die when the step lets go of them, and the storages are counted dead then:
        `look_for_deaths`), with its RNG and autocast state."""
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        aliases: list[torch.Tensor] = []

        def alias(t: torch.Tensor) -> torch.Tensor:
            a = t.detach().requires_grad_(t.requires_grad) if t.is_leaf or t.requires_grad else t.detach()
            key = storage_key(t)
            if key is not None and self.tracker.is_live(key):
                self.held[key] = self.held.get(key, 0) + 1
                self.held_alias[key] = a
                aliases.append(key)
            return a

        args, kwargs = pytree.tree_map_only(torch.Tensor, alias, (tuple(args), dict(kwargs or {})))
        self.calls[i] = _Call(module, args, kwargs, torch.get_rng_state(), cuda, _autocast_state(), aliases)
        self.boxes[i] = []

    def look_for_deaths(self) -> None:
        """Count dead every argument storage that only the held aliases keep (and no box stands for): the
        step let go of it, so the unplanned step would have freed it by now."""
        for key, count in list(self.held.items()):
            if key in self.counted_dead:
                continue
            hold = self.holds.get(key)
            if hold is not None and hold.boxes > 0:
                continue
            alias = self.held_alias[key]
            ours = count + self.rebuilt_refs.get(key, 0) + 1  # (+1: the storage's Python object)
            if torch._C._storage_Use_Count(alias.untyped_storage()._cdata) <= ours:
                self.counted_dead[key] = nbytes = self.tracker._live.get(key, 0)
                self.tracker.forget(key)
                self.tracker.extra_held_bytes += nbytes  # (dead to the step, held here)

    def _let_go_of_arguments(self, call: _Call) -> None:
        for key in call.held_keys:
            left = self.held[key] - 1
            if left:
                self.held[key] = left
            else:
                del self.held[key], self.held_alias[key]
                self.tracker.extra_held_bytes -= self.counted_dead.pop(key, 0)
        call.held_keys = []
        call.args, call.kwargs = (), {}

    def box(self, t: torch.Tensor, i: int | None, key: Any, droppable: bool) -> SavedBox:
        """The box for `t`, saved now in block call `i` (None: outside every block); `key`: its storage."""
        if i is None or i not in self.boxes:
            return SavedBox(t, None, -1)
        boxes = self.boxes[i]
        box = SavedBox(t, i, len(boxes), key)
        boxes.append(box)
        if not droppable:
            box.block = None  # kept: it is never rebuilt
        return box

    def leave(self, i: int, replayable: bool) -> None:
        """Block call `i`'s forward is over: its boxes let go of what it made (not when a run again would
        repeat a Python state write: it keeps them, as every plan keeps that block)."""
        boxes = self.boxes.pop(i, [])
        dropped = [b for b in boxes if b.block is not None] if replayable else []
        if not dropped:
            self._forget_call(i)
            return
        for b in dropped:  # every hold first: a storage may die as soon as its last box lets go
            key = b.key
            hold = self.holds.get(key)
            if hold is None:
                hold = self.holds[key] = _Hold(key, nbytes=storage_bytes(b.tensor))
            hold.boxes += 1
            b.hold = hold
            weakref.finalize(b, self._box_died, hold, i).atexit = False
        self.open[i] = len(dropped)
        self.blocks_let_go += 1
        for b in dropped:
            b.tensor = None

    def _death(self, key: Any) -> bool:
        """The tracker saw the storage at `key` die: counted on while a box stands for it."""
        hold = self.holds.pop(key, None)
        if hold is None or hold.boxes == 0 or not self.tracker.is_live(key):
            return False
        new_key = ("released", next(_released_keys))
        hold.nbytes = self.tracker.rename(key, new_key)
        hold.key, hold.gone = new_key, True
        self.tracker.released_bytes += hold.nbytes
        self._rename(key, new_key)
        return True

    def _box_died(self, hold: _Hold, block: int) -> None:
        hold.boxes -= 1
        if hold.boxes == 0:
            if hold.gone:
                self.tracker.released_bytes -= hold.nbytes
                self.tracker._free(hold.key)
            elif self.holds.get(hold.key) is hold:
                del self.holds[hold.key]  # the step still holds it: its death is the tracker's as usual
                if hold.key in self.held:  # (or a held argument only: counted dead now)
                    self.look_for_deaths()
        left = self.open.get(block)
        if left is not None:
            self.open[block] = left - 1
            if left == 1:  # the block's backward is over: what was rebuilt for it goes
                self._drop_rebuilt(block)

    # -- the backward
    def unpack(self, box: SavedBox) -> torch.Tensor:
        if box.tensor is not None:
            return box.tensor
        i = box.block
        assert i is not None
        if i not in self.rebuilt:
            self._rebuild(i)
        found = self.rebuilt[i].take(box.index)
        if found is None or found.shape != box.shape or found.dtype != box.dtype:
            got = "nothing" if found is None else f"{tuple(found.shape)} {found.dtype}"
            raise RecomputeMismatch(
                f"block call {i} run again saved {got} as its tensor {box.index}, where its forward saved "
                f"{tuple(box.shape)} {box.dtype}: its forward depends on something besides its arguments, RNG and "
                "autocast state"
            )
        return found

    def _rebuild(self, i: int) -> None:
        call = self.calls[i]
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> None:
            # detached: its graph's nodes keep this hook, which keeps `saved`; the graph holds nothing
            saved.append(t.detach())

        devices = [torch.cuda.current_device()] if call.cuda_rng is not None else []
        inner = LiveBytesTracker()
        limit = self.tracker.limit_bytes
        if limit is not None:
            inner.limit_bytes = limit - self.tracker.held_bytes()
        with contextlib.ExitStack() as stack:
            # the probe's own counters do not see the run again; a mode entered around the probe does
            top = _get_current_dispatch_mode() is self.tracker
            stack.enter_context(_pop_mode_temporarily() if top else _disable_current_modes())
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(call.cpu_rng)
            if call.cuda_rng is not None:
                torch.cuda.set_rng_state(call.cuda_rng)
            for device, enabled, dtype in call.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(inner)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: keep(t), _no_unpack))
            self.recomputing = True
            try:
                self._run_again(i, call.module, call.args, call.kwargs)
            finally:
                self.recomputing = False
        aliases = {id(a) for c in self.calls.values() for a in pytree.tree_leaves((c.args, c.kwargs))}
        rebuilt = self.rebuilt[i] = _Rebuilt(self, saved, aliases, set(inner._live))
        peak = self.tracker.held_bytes() - rebuilt.counted_bytes + inner.peak_bytes
        self.tracker.max_held_bytes = max(self.tracker.max_held_bytes, peak)

    def _drop_rebuilt(self, i: int) -> None:
        rebuilt = self.rebuilt.pop(i, None)
        if rebuilt is not None:
            rebuilt.drop()
        self._forget_call(i)

    def _forget_call(self, i: int) -> None:
        call = self.calls.pop(i, None)
        if call is not None:
            self._let_go_of_arguments(call)
            self.look_for_deaths()

    def release(self) -> None:
        """The pass is over (or stopped): nothing rebuilt or held for a rebuild stays."""
        for i in list(self.rebuilt):
            self._drop_rebuilt(i)
        self.calls.clear()
        self.boxes.clear()
        self.held.clear()
        self.held_alias.clear()
        self.tracker.extra_held_bytes -= sum(self.counted_dead.values())
        self.counted_dead.clear()
        self.tracker.on_death = self.tracker.before_op = None


class _Rebuilt:
    """The tensors a block's run again saved, each let go once its box took it (as torch's checkpoint
    does); a tensor taken lives on in the backward until its node is done with it. Until its storage dies,
    the tracker holds its bytes (`extra_held_bytes`, unless it counts that storage live already), and
    `RecomputedSaves.rebuilt_refs` counts the tensors held here on a held argument's storage."""

    def __init__(self, saves: RecomputedSaves, tensors: list[torch.Tensor], aliases: set[int], made: set) -> None:
        """`made`: the storages the run again made (not a parameter's or any other that existed before it)."""
        self.saves, self.tensors = saves, list(tensors)
        self.nbytes: dict[Any, int] = {}  # storage counted here -> its bytes
        tracker = saves.tracker
        for t in {id(t): t for t in tensors}.values():
            key = storage_key(t)
            if key is None or id(t) in aliases:  # (a held alias itself is counted already)
                continue
            if key not in self.nbytes and key in made:
                self.nbytes[key] = storage_bytes(t)
                # (the pass keeps the weak reference: a reference that dies first calls nothing)
                saves.watched.append(weakref.ref(t.untyped_storage(), lambda _r, key=key: self._storage_gone(key)))
            if key in saves.held:
                saves.rebuilt_refs[key] = saves.rebuilt_refs.get(key, 0) + 1
                weakref.finalize(t, self._tensor_gone, key).atexit = False
        self.counted_bytes = sum(self.nbytes.values())
        tracker.extra_held_bytes += self.counted_bytes

    def take(self, index: int) -> torch.Tensor | None:
        if index >= len(self.tensors):
            return None
        t, self.tensors[index] = self.tensors[index], None
        return t

    def _storage_gone(self, key: Any) -> None:
        n = self.nbytes.pop(key, 0)
        self.counted_bytes -= n
        self.saves.tracker.extra_held_bytes -= n

    def _tensor_gone(self, key: Any) -> None:
        refs = self.saves.rebuilt_refs
        left = refs.get(key, 0) - 1
        if left > 0:
            refs[key] = left
        else:
            refs.pop(key, None)

    def drop(self) -> None:
        self.tensors = []


def _no_unpack(_: Any) -> Any:
    raise RuntimeError("a block run again for its saved tensors runs no backward of its own")
