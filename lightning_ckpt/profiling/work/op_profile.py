"""Per-op profile of a block's forward: one `OpCost` per op call, named as selective checkpointing names it.

`OpProfileRecorder` is fed each op once by `OpBytesCounter` (with its FLOPs and bytes written)
while a block's forward runs, and each storage autograd saves by the profiler's saved-tensor
hook. It names calls with `OpCallCounter`, tracks which calls wrote each storage, and at the
end of the block's forward returns its calls as `OpCost`s (bytes held if kept, saved by
backward, keepable, after the block's last saved tensor, work).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_ckpt.costs.block_costs import OpCost
from lightning_ckpt.profiling.work.op_keys import OpCallCounter, is_random_op
from lightning_ckpt.profiling.memory.tracker import flat_tensors, storage_bytes, storage_key

__all__ = ["OpProfileRecorder", "kept_draw_bytes", "written_args", "zero_one_draws"]

_written_cache: dict[Any, tuple[tuple[int, str], ...]] = {}


def written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments `func` writes in place, from its schema (`self` of
    `bernoulli_`, `out` of an out= overload, the running stats of a batch norm)."""
    found = _written_cache.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments if schema is not None else ())
            if a.alias_info is not None and a.alias_info.is_write
        )
        _written_cache[func] = found
    return found


def zero_one_draws(func: Any) -> bool:
    """Whether every value `func` writes is +0 or +1 by definition (bernoulli draws): its kept draws
    are stored as one byte per element (`apply.kept_draws`)."""
    return getattr(func, "_overloadpacket", None) in (torch.ops.aten.bernoulli_, torch.ops.aten.bernoulli)


def kept_draw_bytes(func: Any, outs: Sequence[torch.Tensor]) -> int:
    """Bytes the copy that keeps a random call's draws holds (`apply.kept_draws`): one byte per
    element of a bernoulli mask, else a clone of each output (its elements at their size). A
    random op need not write 0/1: dropout's `native_dropout` returns the scaled output beside its
    mask, and the CPU's fused attention (`_scaled_dot_product_flash_attention_for_cpu`, tagged
    random for its dropout even at probability 0) its output and log-sum-exp."""
    if zero_one_draws(func):
        return sum(t.numel() * (t.element_size() if t.is_complex() else 1) for t in outs)
    return sum(t.numel() * t.element_size() for t in outs)


def _tensor_keys(values: Any) -> set:
    keys = {storage_key(t) for t in flat_tensors(values)}
    keys.discard(None)
    return keys


class _Call:
    """What is known of one call while its block runs (mutable; `OpCost` is made at the end)."""

    __slots__ = ("flops", "keep_bytes", "keepable", "key", "mem_bytes", "random", "rng_bytes")

    def __init__(
        self, key: tuple[str, int], keep_bytes: int, keepable: bool, random: bool, flops: int, mem: int, rng: int
    ):
        self.key = key
        self.keep_bytes = keep_bytes
        self.keepable = keepable  # outputs all new storages, none written in place later in the block
        self.random = random
        self.flops = flops
        self.mem_bytes = mem
        self.rng_bytes = rng


class OpProfileRecorder:
    """The op calls of one block's forward at a time: `begin()`, then `record` per op and
    `packed` per saved tensor, then `end()` -> the block's `OpCost`s in call order.

    A call's storages: those its outputs were created on, and those it wrote in place. A
    saved storage marks every call of the block that created or wrote it (dropout's noise,
    saved by its `mul`, marks `empty_like`, `bernoulli_` and `div_`), resolved when the
    tensor is saved, so a storage freed and reused later in the block is not confused.
    """

    def __init__(self) -> None:
        self._counter = OpCallCounter()
        self._calls: list[_Call] = []
        self._writers: dict[Any, list[int]] = {}  # storage -> calls that created (first) or wrote it
        self._created: dict[Any, int] = {}  # storage -> the call that created it in this block
        self._saved: set[int] = set()
        self._calls_at_last_pack = 0

    def begin(self) -> None:
        """A block's forward starts: calls are numbered from 0 again."""
        self._counter.reset()
        self._calls = []
        self._writers = {}
        self._created = {}
        self._saved = set()
        self._calls_at_last_pack = 0

    def record(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        outs: Sequence[torch.Tensor],
        flops: int,
        mem_bytes: int,
        rng_bytes: int,
        inputs: set | None = None,
        out_keys: Sequence[Any] | None = None,
        traits: Any = None,
    ) -> None:
        """One op call, seen once at the top of the dispatch modes; `outs` its tensor outputs. `inputs`
        and `out_keys`, when the caller has them, are the storage keys of its arguments and of `outs`;
        `traits` the op's `op_traits.OpTraits`."""
        if traits is None:
            key = self._counter.key(func)
            if key is None:
                return  # selective checkpointing does not number it (`detach`, metadata ops)
            is_view, positions, random = getattr(func, "is_view", False), written_args(func), is_random_op(func)
        else:
            if not traits.counted:
                return
            key = self._counter.key_named(traits.name)
            is_view, positions, random = traits.is_view, traits.written_args, traits.random
        index = len(self._calls)
        keep = 0
        keepable = False
        if outs and not is_view:
            written = self._written_keys(positions, args, kwargs, index)
            if inputs is None:
                inputs = _tensor_keys((args, kwargs))
            if out_keys is None:
                out_keys = [storage_key(t) for t in outs]
            aliased = False
            for t, k in zip(outs, out_keys):
                if k is None or k in inputs or k in written:
                    aliased = True
                elif self._created.get(k, -1) != index:  # a new storage, counted once per call
                    self._created[k] = index
                    self._writers[k] = [index]
                    keep += storage_bytes(t)
            keepable = not aliased and not written
        random = bool(outs) and random
        if random:
            keep = kept_draw_bytes(func, outs)
        self._calls.append(_Call(key, keep, keepable, random, int(flops), mem_bytes, rng_bytes))

    def _written_keys(self, positions: tuple, args: tuple, kwargs: dict, index: int) -> set:
        """Storages the op writes in place (`positions`: its `written_args`); a call of this block that
        created one is no longer keepable (selective checkpointing refuses a kept output changed later)."""
        if not positions:
            return set()
        keys = _tensor_keys([args[i] if i < len(args) else kwargs.get(name) for i, name in positions])
        for k in keys:
            creator = self._created.get(k)
            if creator is not None:
                self._calls[creator].keepable = False
            self._writers.setdefault(k, []).append(index)
        return keys

    def packed(self, key: Any) -> None:
        """Autograd saved a tensor now; `key` its storage (None for one that is not the
        block's activation: a parameter, the batch)."""
        self._calls_at_last_pack = len(self._calls)
        if key is not None:
            self._saved.update(self._writers.get(key, ()))

    def end(self) -> tuple[OpCost, ...]:
        """The block's forward is over: its calls in order."""
        tail_from = self._calls_at_last_pack
        return tuple(
            OpCost(
                op=c.key[0],
                call_index=c.key[1],
                keep_bytes=c.keep_bytes,
                saved=i in self._saved,
                keepable=c.keepable or c.random,  # a random call's draws can be kept whatever writes them later
                in_tail=i >= tail_from,
                flops=c.flops,
                mem_bytes=c.mem_bytes,
                rng_bytes=c.rng_bytes,
            )
            for i, c in enumerate(self._calls)
        )
