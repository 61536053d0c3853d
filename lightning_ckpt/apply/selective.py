"""Op-level (selective) checkpointing of a block checkpointed alone: some op calls are kept, not recomputed.

`SelectiveKeep` holds the op-call keys a plan keeps for one block (named as `OpCallCounter`
names them) and builds, for each checkpointed forward, the contexts its forward and its
recompute run under: torch's selective checkpoint modes (kept calls MUST_SAVE, the rest
recomputed) stacked above this module's own modes, which keep kept random draws (a compact
copy plus the generator state after the draw) and replay them in the recompute. A block
that keeps only random calls needs no caching modes: its own modes alone keep them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from lightning_ckpt.profiling.op_keys import OpCallCounter, is_random_op
from lightning_ckpt.profiling.tracker import storage_key

__all__ = ["SelectiveKeep", "validate_keep_ops"]

OpKey = tuple[str, int]

_RANDOM: dict[Any, bool] = {}
_USED = object()  # a kept draw the recompute has replayed (and freed)


def _is_random(func: Any) -> bool:
    found = _RANDOM.get(func)
    if found is None:
        found = _RANDOM[func] = is_random_op(func)
    return found


def _written(func: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments `func` writes in place, from its schema."""
    schema = getattr(func, "_schema", None)
    args = schema.arguments if schema is not None else ()
    return [(i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]


def _op_of(name: str) -> Any:
    """The op overload named `name` ("aten.bernoulli_.float"), or None when there is none."""
    namespace, _, rest = name.partition(".")
    packet, _, overload = rest.rpartition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        return None
    return op if str(op) == name else None


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def validate_keep_ops(
    keep_ops: Mapping[int, Collection[OpKey]] | None,
    spans: Sequence[tuple[int, int]],
    n_blocks: int,
    inner_segments: Sequence[tuple[int, int]] = (),
) -> dict[int, frozenset[OpKey]]:
    """`keep_ops` as block index -> frozen set of keys, or a ValueError saying what is wrong.
    A key names a one-block segment, of `spans` or of the nested `inner_segments`."""
    spans = list(spans) + list(inner_segments)
    out: dict[int, frozenset[OpKey]] = {}
    for index, keys in (keep_ops or {}).items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_blocks:
            raise ValueError(
                f"keep_ops names block {index!r}, but blocks are numbered 0..{n_blocks - 1}; "
                "its keys are the indices of the blocks passed to apply_segments."
            )
        if (index, index) not in spans:
            around = [s for s in spans if s[0] <= index <= s[1]]
            where = min(around, key=lambda s: s[1] - s[0]) if around else None
            state = f"inside the segment {where}" if where else "not in any segment (it is not checkpointed)"
            raise ValueError(
                f"keep_ops names block {index}, which is {state}; op calls can be kept only in a block "
                f"checkpointed on its own. Give it the one-block segment ({index}, {index}) or drop it from keep_ops."
            )
        if isinstance(keys, (str, bytes)) or (
            isinstance(keys, tuple) and len(keys) == 2 and isinstance(keys[0], str) and isinstance(keys[1], int)
        ):
            raise ValueError(
                f"keep_ops[{index}] is the single value {keys!r}; it must be a collection of op-call keys, "
                "e.g. [('aten.addmm.default', 0)]."
            )
        checked = set()
        for key in keys:
            if not (
                isinstance(key, (tuple, list)) and len(key) == 2 and isinstance(key[0], str)
                and isinstance(key[1], int) and not isinstance(key[1], bool) and key[1] >= 0
            ):
                raise ValueError(
                    f"keep_ops[{index}] holds {key!r}, which is not an op-call key; a key is "
                    "(op name, call index) as OpCallCounter names calls, e.g. ('aten.mm.default', 0)."
                )
            checked.add((key[0], key[1]))
        out[index] = frozenset(checked)
    return out


def _describe(keys: Collection[OpKey]) -> str:
    """'aten.addmm.default 0..3; aten.gelu.default 0' for the error messages."""
    by_op: dict[str, list[int]] = {}
    for name, idx in keys:
        by_op.setdefault(name, []).append(idx)
    parts = []
    for name in sorted(by_op):
        idx = sorted(by_op[name])
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        parts.append(f"{name} {idx[0]}..{idx[-1]}" if contiguous and len(idx) > 1 else f"{name} {', '.join(map(str, idx))}")
    return "; ".join(parts) if parts else "none"


# --------------------------------------------------------------------------- kept random draws


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        raise RuntimeError(
            f"a kept random op call runs on {device}, whose default generator torch does not expose; "
            "its draws cannot be replayed. Do not keep random calls on this device."
        )
    return generators[device.index if device.index is not None else module.current_device()]


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zero_one(func: Any) -> bool:
    """Ops whose every output value is +0 or +1 by definition (bernoulli draws)."""
    return getattr(func, "_overloadpacket", None) in (torch.ops.aten.bernoulli_, torch.ops.aten.bernoulli)


def _compact(t: torch.Tensor, zero_one: bool = False) -> tuple[torch.Tensor, torch.dtype | None]:
    """A lossless copy of `t`: one byte per element (bool) when every value is exactly 0 or +1
    (a bernoulli mask), else a clone. Returns (copy, dtype to restore it to, None if none).

    Lossless bit for bit: the bool copy turned back must have the bits of `t` (so -0.0 or a
    NaN keeps the dtype); compared as integers, as `torch.equal` on floats would not tell.
    `zero_one`: the op writes only +0 and +1 by definition (`bernoulli`), so the check, a
    pass over the draws as long as drawing them again, is skipped: one uint8 per element
    (copied back into a float tensor faster than a bool)."""
    if zero_one and not t.is_complex() and t.dtype != torch.bool:
        return t.to(torch.uint8), t.dtype
    as_int = _SAME_SIZE_INT.get(t.element_size())
    if t.dtype == torch.bool or t.is_complex() or as_int is None:
        return t.clone(), None
    packed = t.to(torch.bool)
    back = packed.to(t.dtype)
    if t.is_floating_point():
        back, original = back.view(as_int), t.view(as_int)
    else:
        original = t
    if torch.equal(back, original):
        return packed, t.dtype
    return t.clone(), None


def _restore(copy: Any, dtype: torch.dtype | None) -> Any:
    return copy.to(dtype) if dtype is not None else copy


class _KeptDraw:
    """One kept random call: its values, the generator it drew from and that generator's state after the draw."""

    __slots__ = ("generator", "spec", "state", "target", "values")

    def __init__(self, func: Any, args: tuple, kwargs: dict, out: Any, block: int, key: OpKey) -> None:
        written = _written(func)
        self.target = None
        if written:
            target = _argument(args, kwargs, *written[0])
            if len(written) != 1 or not (isinstance(out, torch.Tensor) and storage_key(out) == storage_key(target)):
                raise ValueError(
                    f"keep_ops[{block}] keeps {key}, a random call that writes {[n for _, n in written]} in place "
                    "and does not return the tensor it writes; its draws cannot be replayed. Drop it from keep_ops."
                )
            self.target = written[0]
            self.values, self.spec = [_compact(target, _zero_one(func))], None
            device = target.device
        else:
            flat, self.spec = tree_flatten(out)
            self.values = [_compact(v, _zero_one(func)) if isinstance(v, torch.Tensor) else (v, None) for v in flat]
            device = _tensors(out)[0].device
        positions = [i for i, a in enumerate(func._schema.arguments) if a.name == "generator"]
        explicit = _argument(args, kwargs, positions[0], "generator") if positions else None
        # An explicit generator is the caller's: the replay draws nothing from it and leaves it alone.
        # The default generator is forked by checkpoint around the recompute: set it to its state after
        # this draw, so the random calls after it draw in the recompute what they drew in the forward.
        self.generator = None if explicit is not None else _default_generator(device)
        self.state = self.generator.get_state() if self.generator is not None else None

    def replay(self, args: tuple, kwargs: dict) -> Any:
        if self.generator is not None:
            self.generator.set_state(self.state)
        if self.target is not None:
            target = _argument(args, kwargs, *self.target)
            target.copy_(self.values[0][0])
            return target
        return tree_unflatten([_restore(*v) for v in self.values], self.spec)


class _DrawKeeper(TorchDispatchMode):
    """Forward mode, below torch's caching mode: keeps the draws of the kept random calls.

    Below, so the ops it runs to copy the draws are not numbered by selective checkpointing.
    Other ops pass straight through after one dictionary lookup, unless it records the key of
    every call (`seen`: a block without caching modes, on the forward that checks its keys).
    """

    def __init__(self, keys: frozenset[OpKey], block: int, record_calls: bool) -> None:
        super().__init__()
        self.keys = keys
        self.block = block
        self.counter = OpCallCounter()
        self.draws: dict[OpKey, Any] = {}
        self.seen: list[OpKey] | None = [] if record_calls else None
        self._all = OpCallCounter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.seen is not None:
            key = self._all.key(func)
            if key is not None:
                self.seen.append(key)
        if _is_random(func):
            key = self.counter.key(func)
            if key in self.keys:
                self.draws[key] = _KeptDraw(func, args, kwargs, out, self.block, key)
        return out


class _DrawReplayer(TorchDispatchMode):
    """Recompute mode, below torch's cached mode: a kept random call draws nothing; its kept values
    are written to its output and the generator is set to its state after the forward's draw."""

    def __init__(self, keeper: _DrawKeeper) -> None:
        super().__init__()
        self.keeper = keeper
        self.counter = OpCallCounter()

    def __enter__(self):
        self.counter.reset()
        return super().__enter__()

    def __exit__(self, *exc: object) -> Any:
        try:
            return super().__exit__(*exc)
        finally:  # draws an early-stopped recompute did not reach are freed too
            draws = self.keeper.draws
            for key in draws:
                draws[key] = _USED

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_random(func):
            return func(*args, **kwargs)
        key = self.counter.key(func)
        draw = self.keeper.draws.get(key)
        if draw is None:
            return func(*args, **kwargs)
        if draw is _USED:
            raise RuntimeError(
                f"block {self.keeper.block} is recomputed a second time for one forward, but its kept random "
                f"draw {key} was freed after the first recompute. Selective checkpointing allows one backward "
                "per forward through a block (as torch's selective checkpoint contexts); backward once."
            )
        self.keeper.draws[key] = _USED
        return draw.replay(args, kwargs)


# --------------------------------------------------------------------------- the policy


class _KeepPolicy:
    """torch's policy function for one forward: MUST_SAVE for the kept calls that are not random."""

    def __init__(self, keys: frozenset[OpKey], block: int, record_calls: bool) -> None:
        self.keys = keys
        self.block = block
        self.counter = OpCallCounter()  # numbers calls exactly as torch's caching mode does
        self.seen: list[OpKey] | None = [] if record_calls else None
        self.kept: list[tuple[OpKey, list[tuple[torch.Tensor, int]]]] = []
        self.failed = False

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = self.counter.key(func)
        if self.seen is not None:
            self.seen.append(key)
        if key not in self.keys or _is_random(func):
            return CheckpointPolicy.PREFER_RECOMPUTE  # random draws are kept by `_DrawKeeper`
        reason = self._why_not(func, args, kwargs, ctx.op_output)
        if reason:
            self.failed = True
            raise ValueError(
                f"keep_ops[{self.block}] keeps {key}, but {reason}; selective checkpointing can keep only "
                "calls that make new tensors. Drop it from keep_ops (the planner offers only keepable calls)."
            )
        self.kept.append((key, [(t, t._version) for t in _tensors(ctx.op_output)]))
        return CheckpointPolicy.MUST_SAVE

    @staticmethod
    def _why_not(func: Any, args: tuple, kwargs: dict, out: Any) -> str:
        if getattr(func, "is_view", False):
            return "it is a view of its input (the view would be cached, not a tensor of its own)"
        written = _written(func)
        if written:
            return f"it writes its argument {written[0][1]!r} in place"
        inputs = {storage_key(t) for t in _tensors((args, kwargs))}
        if any(storage_key(t) in inputs for t in _tensors(out)):
            return "its output shares storage with one of its inputs"
        return ""

    def check(self) -> None:
        """After the forward: the kept outputs are unchanged."""
        kept, self.kept = self.kept, []
        for key, outs in kept:
            if any(t._version != v for t, v in outs):
                raise ValueError(
                    f"keep_ops[{self.block}] keeps {key}, but its output is written in place later in the "
                    "block's forward; a kept tensor must not change (torch would refuse it in the backward). "
                    "Drop it from keep_ops."
                )


def _check_keys_seen(block: int, keys: frozenset[OpKey], seen: list[OpKey]) -> None:
    missing = keys - set(seen)
    if missing:
        raise ValueError(
            f"keep_ops[{block}] names op calls the block's forward never made: {sorted(missing)}. "
            f"The calls it made: {_describe(set(seen))}. A key is (str(op), index among the block's "
            "calls of that op) as OpCallCounter numbers them; profile the block again or correct the keys."
        )


# --------------------------------------------------------------------------- the contexts


class _Stacked:
    """Enters `contexts` in order (a later dispatch mode sits above an earlier one) and runs
    `after` on a clean exit. Re-enterable: each entry has its own ExitStack."""

    def __init__(self, contexts: Sequence[Any], after: Callable[[], None] | None = None) -> None:
        self.contexts = list(contexts)
        self.after = after
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        try:
            for c in self.contexts:
                stack.enter_context(c)
        except BaseException:
            stack.close()
            raise
        self._stacks.append(stack)

    def __exit__(self, *exc: object) -> bool:
        self._stacks.pop().__exit__(*exc)
        if exc[0] is None and self.after is not None:
            self.after()
        return False


class SelectiveKeep:
    """The kept op calls of one block and the contexts that keep them (a picklable object)."""

    def __init__(self, block: int, keys: frozenset[OpKey]) -> None:
        self.block = block
        self.keys = keys
        self.validated = False  # set once a forward has made every kept call
        ops = [_op_of(name) for name, _ in keys]
        self.random_only = all(op is not None and is_random_op(op) for op in ops)

    def contexts(self, recompute_context: Any) -> tuple[_Stacked, _Stacked]:
        """(forward, recompute) contexts for one checkpointed forward; `recompute_context` is
        entered first in the recompute (segment hooks off, BatchNorm guarded)."""
        if self.random_only:
            keeper = _DrawKeeper(self.keys, self.block, record_calls=not self.validated)
            return (
                _Stacked([keeper], lambda: self._after_forward(keeper.seen, None)),
                _Stacked([recompute_context, _DrawReplayer(keeper)]),
            )
        policy = _KeepPolicy(self.keys, self.block, record_calls=not self.validated)
        caching, cached = create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=False)
        keeper = _DrawKeeper(self.keys, self.block, record_calls=False)
        return (
            _Stacked([keeper, caching], lambda: self._after_forward(policy.seen, policy)),
            _Stacked([recompute_context, _DrawReplayer(keeper), cached]),
        )

    def _after_forward(self, seen: list[OpKey] | None, policy: _KeepPolicy | None) -> None:
        # A forward aborted by an exception also ends here (the segment's always-called hook):
        # it is not checked, as it never reached its later calls.
        if (policy is not None and policy.failed) or sys.exc_info()[1] is not None:
            if policy is not None:
                policy.kept = []
            return
        if policy is not None:
            policy.check()
        if not self.validated and seen is not None:
            _check_keys_seen(self.block, self.keys, seen)
            self.validated = True
