"""Deterministic measurement of live tensor bytes.

`LiveBytesTracker` is a `TorchDispatchMode` that sees every tensor an op creates,
counts each storage once while it is alive (a weak-reference finalizer drops it
when freed) and keeps a running peak. It is exact and repeatable on CPU, unlike
RSS. `measure_peak` wraps one callable; on CUDA `cuda_peak` reads the allocator.
`StepBytesTracker` counts the same for a step whose existing storages are all adopted,
reading only op schemas and results: cheap enough to measure a training step by default.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ckpt.profiling.memory.collective_release import call_op, is_issued_collective
from lightning_ckpt.profiling.memory.limit_check import bound_bytes, result_bytes

__all__ = [
    "LiveBytesOverLimit", "LiveBytesTracker", "StepBytesTracker", "flat_tensors", "local_tensor", "storage_bytes",
    "storage_key", "unique_storage_bytes",
]


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, through tuples, lists and dicts: what an op takes and returns.

    Dispatch modes see every op, so this stands in for `torch.utils._pytree.tree_flatten` on
    their hot path, which also looks for every registered container type: op arguments and
    results hold no other containers.
    """
    if isinstance(value, torch.Tensor):
        return [value]
    out: list[torch.Tensor] = []
    if isinstance(value, (tuple, list)):
        _collect(value, out)
    elif isinstance(value, dict):
        _collect(value.values(), out)
    return out


_ATOMS = frozenset({int, float, bool, str, type(None)})  # what most op arguments are: never a tensor


def _collect(values: Iterable[Any], out: list[torch.Tensor]) -> None:
    """Append the tensors in `values` to `out`, depth first, in order."""
    for v in values:
        if type(v) in _ATOMS:
            continue
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            for x in v:  # a list of sizes or strides holds no tensor: no call made for it
                if type(x) not in _ATOMS:
                    _collect(v, out)
                    break
        elif isinstance(v, dict):
            _collect(v.values(), out)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding `t`'s bytes on this process: a DTensor's local shard, else `t` itself."""
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2, tensor parallel)
    return local if isinstance(local, torch.Tensor) else t


_DEVICES: dict[torch.device, tuple[str, bool]] = {}  # device -> (its name in keys, whether it is meta)
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})  # types that hold their own bytes (no DTensor is one)


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, data pointer) of the storage behind `t`; None for meta, empty or storage-less tensors
    (a storage FSDP2 freed by resizing it to 0 bytes, a wrapper subclass without data)."""
    if type(t) not in _PLAIN:  # `local_tensor`, inline: this runs for every tensor of every op
        local = getattr(t, "_local_tensor", None)
        t = local if isinstance(local, torch.Tensor) else t
    try:  # device names are kept: this runs for every tensor an op takes or makes
        st = t.untyped_storage()
        device = st.device
        found = _DEVICES.get(device)
        if found is None:
            found = _DEVICES[device] = (str(device), device.type == "meta")
        if found[1] or st.nbytes() == 0:
            return None
        return (found[0], st.data_ptr())
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


_UNKNOWN = object()


class LiveBytesOverLimit(torch.OutOfMemoryError):
    """The tracked live bytes went over the tracker's `limit_bytes`: raised from the op that made
    the storage, as an allocator raises when memory runs out (it is an `OutOfMemoryError`). `reached_bytes`:
    what was held with that storage; `limit_bytes`: the limit it went over."""

    reached_bytes: int | None = None
    limit_bytes: int | None = None


class LiveBytesTracker(TorchDispatchMode):
    """Counts bytes of storages created by ops while the mode is active.

    `live_bytes` is what is alive now, `peak_bytes` the most seen since the last
    `reset_peak()`. Storages that existed before the mode (parameters, the batch)
    are not counted: add a baseline yourself (`unique_storage_bytes`) when you
    want the whole picture. `device` limits counting to one device type. A `ledger`
    (`lifetimes.StorageLedger`) is told of every storage made, read and freed. With
    `limit_bytes` set, the op whose new storage takes `live_bytes` over it raises
    `LiveBytesOverLimit` (`profiling.passes.profile_budget` stops a profiling pass so). Storages passed
    to `ignore` are never counted (what an offloading strategy keeps in host memory, on a machine
    whose device is the CPU too).
    """

    def __init__(self, device: str | None = None, ledger: Any = None) -> None:
        super().__init__()
        self.device = device
        self.ledger = ledger
        self.live_bytes = 0
        self.peak_bytes = 0
        self.limit_bytes: int | None = None
        self.max_live_bytes = 0  # the most seen while active, whatever `reset_peak` did
        # Storages counted live that the step no longer holds (a pass under checkpointing lets a block's
        # saved tensors go and counts them on, `recompute_probe`), and what it holds besides the tracked:
        # the limit and `max_held_bytes` are of what is really held.
        self.released_bytes = 0
        self.extra_held_bytes = 0
        self.max_held_bytes = 0
        self.largest_bytes = 0  # the largest storage counted: how near the limit an op is checked before it runs
        self.on_death: Any = None  # key -> True when the death is taken over (counted on under a new key)
        self.before_op: Any = None  # called before every op (a holder that is not the step's looks for deaths)
        self._live: dict[tuple[str, int], int] = {}
        self._finalizers: list[weakref.ref] = []
        self._ignored: set[tuple[str, int]] = set()

    def ignore(self, tensors: Iterable[Any]) -> None:
        """Never count the storages of `tensors` (adopted or seen in an op)."""
        self._ignored.update(k for t in tensors if isinstance(t, torch.Tensor) and (k := storage_key(t)) is not None)

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

    def held_bytes(self) -> int:
        """What the step really holds now: the live bytes less those let go, plus the held untracked."""
        return self.live_bytes - self.released_bytes + self.extra_held_bytes

    def rename(self, key: Any, new_key: Any) -> int:
        """Count the storage at `key` on under `new_key` (its own storage died) -> its bytes."""
        nbytes = self._live.pop(key)
        self._live[new_key] = nbytes
        if self.ledger is not None:
            self.ledger.rename(key, new_key)
        return nbytes

    def _free(self, key: tuple[str, int]) -> None:
        if self.on_death is not None and self.on_death(key):
            return
        self.forget(key)

    def forget(self, key: Any) -> None:
        """Count the storage at `key` dead now (it died, or only a holder that is not the step's holds it)."""
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.live_bytes -= nbytes
            if self.ledger is not None:
                self.ledger.freed(key)

    def _track(self, t: torch.Tensor, key: Any = _UNKNOWN) -> None:
        """Count `t`'s storage if it is new (`key`: its `storage_key`, when the caller has it)."""
        if self.device is not None and t.device.type != self.device:
            return
        if key is _UNKNOWN:
            key = storage_key(t)
        if key is None or key in self._live or key in self._ignored:
            return
        st = (t if type(t) in _PLAIN else local_tensor(t)).untyped_storage()
        nbytes = int(st.nbytes())
        self._live[key] = nbytes
        if nbytes > self.largest_bytes:
            self.largest_bytes = nbytes
        live = self.live_bytes = self.live_bytes + nbytes
        if live > self.peak_bytes:
            self.peak_bytes = live
        if live > self.max_live_bytes:
            self.max_live_bytes = live
        if self.ledger is not None:
            self.ledger.born(key, nbytes)
        # a weak reference whose callback frees it (what `weakref.finalize` does, for a fraction of its cost)
        self._finalizers.append(weakref.ref(st, lambda _ref, key=key: self._free(key)))
        held = live - self.released_bytes + self.extra_held_bytes
        if held > self.max_held_bytes:
            self.max_held_bytes = held
        if self.limit_bytes is not None and held > self.limit_bytes:
            raise self._over(held, nbytes, "with")

    def _over(self, held: int, nbytes: int, how: str) -> LiveBytesOverLimit:
        err = LiveBytesOverLimit(
            f"live tensor bytes reached {held} {how} a storage of {nbytes} bytes, over the limit of "
            f"{self.limit_bytes} bytes"
        )
        err.reached_bytes, err.limit_bytes = held, self.limit_bytes
        return err

    def check_before(self, func: Any, args: tuple, kwargs: dict | None, flat: list[torch.Tensor]) -> None:
        """With a limit, `LiveBytesOverLimit` before op `func` runs when its results would take what is held
        over it (`limit_check`: near the limit the op is first run on the meta device; `flat`: its tensors)."""
        if self.limit_bytes is None:
            return
        held = self.live_bytes - self.released_bytes + self.extra_held_bytes
        bound = bound_bytes(func, flat)
        if (bound is not None and held + 2 * max(bound, self.largest_bytes) <= self.limit_bytes) or is_issued_collective(func):
            return
        new = result_bytes(func, args, kwargs)
        if new is not None and held + new > self.limit_bytes:
            raise self._over(held + new, new, "before an op made")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.before_op is not None:
            self.before_op()
        if self.limit_bytes is not None:
            self.check_before(func, args, kwargs, flat_tensors((args, kwargs)))
        out = call_op(func, args, kwargs)  # a collective's tensors freed by the step, not its thread
        # Views and in-place results share an input's storage: that storage was either
        # counted when it was made or existed before the mode (a parameter): skip it.
        outs = flat_tensors(out)
        keys = [storage_key(t) for t in outs]
        live = self._live
        if self.ledger is None and all(key is None or key in live for key in keys):
            return out  # nothing to count: the inputs' storages need not be read
        inputs = {storage_key(t) for t in (flat_tensors((args, kwargs)) if kwargs else flat_tensors(args))}
        if self.ledger is not None:
            self.ledger.used(inputs)
        for t, key in zip(outs, keys):
            if key not in inputs:
                self._track(t, key)
        return out

    def __exit__(self, *exc) -> Any:
        result = super().__exit__(*exc)
        # Storages that outlive the mode keep counting only until the mode is gone.
        self._finalizers.clear()  # a dropped weak reference calls nothing
        return result


_ALIASING_OPS = frozenset({"aten::_unsafe_view", "aten::lift"})  # return an input's storage, unannotated
_MAKES_STORAGE: dict[Any, bool] = {}  # op overload -> whether its results are new storage


def _makes_storage(func: Any) -> bool | None:
    """Whether the results of op `func` are new storage by its schema (no result aliases an input);
    None for an operator without a schema."""
    found = _MAKES_STORAGE.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        if schema is None:
            return None
        found = schema.name not in _ALIASING_OPS and all(r.alias_info is None for r in schema.returns)
        _MAKES_STORAGE[func] = found
    return found


class StepBytesTracker(LiveBytesTracker):
    """`LiveBytesTracker` for a whole step, with every storage that existed before it adopted (the model's
    state, the batch): it counts the results of ops whose schema says they make new storage and never
    reads an op's inputs (views and in-place results are skipped by schema), which costs a fraction of
    the general tracker's time per op. A view of a storage neither adopted nor made under it is not
    counted either, and `ledger` is not supported."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        makes = _makes_storage(func)
        if makes is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = call_op(func, args, kwargs)
        if makes:
            if isinstance(out, torch.Tensor):
                self._track(out)
            elif isinstance(out, (tuple, list)):
                for t in flat_tensors(out):
                    self._track(t)
        return out
