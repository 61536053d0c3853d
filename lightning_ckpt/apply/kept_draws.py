"""Random draws kept by an op-level plan: a kept draw (dropout's mask, a sampled noise) is stored as
a compact copy with the generator state after it (`DrawKeeper`, in the forward), and replayed in
the recompute instead of drawn again (`DrawReplayer`), so the generator ends where it would have.
Also the small readers of an op call both this module and `selective` use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_ckpt.profiling.work.op_keys import OpCallCounter, is_random_op
from lightning_ckpt.profiling.work.op_profile import zero_one_draws
from lightning_ckpt.profiling.memory.tracker import storage_key

OpKey = tuple[str, int]

_RANDOM: dict[Any, bool] = {}
_USED = object()  # a kept draw the recompute has replayed (and freed)


def is_random(func: Any) -> bool:
    found = _RANDOM.get(func)
    if found is None:
        found = _RANDOM[func] = is_random_op(func)
    return found


def written_arguments(func: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments `func` writes in place, from its schema."""
    schema = getattr(func, "_schema", None)
    args = schema.arguments if schema is not None else ()
    return [(i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]


def op_named(name: str) -> Any:
    """The op overload named `name` ("aten.bernoulli_.float"), or None when there is none."""
    namespace, _, rest = name.partition(".")
    packet, _, overload = rest.rpartition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        return None
    return op if str(op) == name else None


def argument_at(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


def tensors_of(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


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
        written = written_arguments(func)
        self.target = None
        if written:
            target = argument_at(args, kwargs, *written[0])
            if len(written) != 1 or not (isinstance(out, torch.Tensor) and storage_key(out) == storage_key(target)):
                raise ValueError(
                    f"keep_ops[{block}] keeps {key}, a random call that writes {[n for _, n in written]} in place "
                    "and does not return the tensor it writes; its draws cannot be replayed. Drop it from keep_ops."
                )
            self.target = written[0]
            self.values, self.spec = [_compact(target, zero_one_draws(func))], None
            device = target.device
        else:
            flat, self.spec = tree_flatten(out)
            self.values = [_compact(v, zero_one_draws(func)) if isinstance(v, torch.Tensor) else (v, None) for v in flat]
            device = tensors_of(out)[0].device
        positions = [i for i, a in enumerate(func._schema.arguments) if a.name == "generator"]
        explicit = argument_at(args, kwargs, positions[0], "generator") if positions else None
        # An explicit generator is the caller's: the replay draws nothing from it and leaves it alone.
        # The default generator is forked by checkpoint around the recompute: set it to its state after
        # this draw, so the random calls after it draw in the recompute what they drew in the forward.
        self.generator = None if explicit is not None else _default_generator(device)
        self.state = self.generator.get_state() if self.generator is not None else None

    def replay(self, args: tuple, kwargs: dict) -> Any:
        if self.generator is not None:
            self.generator.set_state(self.state)
        if self.target is not None:
            target = argument_at(args, kwargs, *self.target)
            target.copy_(self.values[0][0])
            return target
        return tree_unflatten([_restore(*v) for v in self.values], self.spec)


class DrawKeeper(TorchDispatchMode):
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
        if is_random(func):
            key = self.counter.key(func)
            if key in self.keys:
                self.draws[key] = _KeptDraw(func, args, kwargs, out, self.block, key)
        return out


class DrawReplayer(TorchDispatchMode):
    """Recompute mode, below torch's cached mode: a kept random call draws nothing; its kept values
    are written to its output and the generator is set to its state after the forward's draw."""

    def __init__(self, keeper: DrawKeeper) -> None:
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
        if not is_random(func):
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
