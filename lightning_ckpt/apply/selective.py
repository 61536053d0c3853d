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
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from lightning_ckpt.apply.kept_draws import (
    DrawKeeper,
    DrawReplayer,
    is_random,
    op_named,
    tensors_of,
    written_arguments,
)
from lightning_ckpt.profiling.work.op_keys import OpCallCounter, is_random_op
from lightning_ckpt.profiling.memory.tracker import storage_key

__all__ = ["SelectiveKeep", "validate_keep_ops"]

OpKey = tuple[str, int]


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
        if key not in self.keys or is_random(func):
            return CheckpointPolicy.PREFER_RECOMPUTE  # random draws are kept by `DrawKeeper`
        reason = self._why_not(func, args, kwargs, ctx.op_output)
        if reason:
            self.failed = True
            raise ValueError(
                f"keep_ops[{self.block}] keeps {key}, but {reason}; selective checkpointing can keep only "
                "calls that make new tensors. Drop it from keep_ops (the planner offers only keepable calls)."
            )
        self.kept.append((key, [(t, t._version) for t in tensors_of(ctx.op_output)]))
        return CheckpointPolicy.MUST_SAVE

    @staticmethod
    def _why_not(func: Any, args: tuple, kwargs: dict, out: Any) -> str:
        if getattr(func, "is_view", False):
            return "it is a view of its input (the view would be cached, not a tensor of its own)"
        written = written_arguments(func)
        if written:
            return f"it writes its argument {written[0][1]!r} in place"
        inputs = {storage_key(t) for t in tensors_of((args, kwargs))}
        if any(storage_key(t) in inputs for t in tensors_of(out)):
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
        ops = [op_named(name) for name, _ in keys]
        self.random_only = all(op is not None and is_random_op(op) for op in ops)

    def contexts(self, recompute_context: Any) -> tuple[_Stacked, _Stacked]:
        """(forward, recompute) contexts for one checkpointed forward; `recompute_context` is
        entered first in the recompute (segment hooks off, BatchNorm guarded)."""
        if self.random_only:
            keeper = DrawKeeper(self.keys, self.block, record_calls=not self.validated)
            return (
                _Stacked([keeper], lambda: self._after_forward(keeper.seen, None)),
                _Stacked([recompute_context, DrawReplayer(keeper)]),
            )
        policy = _KeepPolicy(self.keys, self.block, record_calls=not self.validated)
        caching, cached = create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=False)
        keeper = DrawKeeper(self.keys, self.block, record_calls=False)
        return (
            _Stacked([keeper, caching], lambda: self._after_forward(policy.seen, policy)),
            _Stacked([recompute_context, DrawReplayer(keeper), cached]),
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
