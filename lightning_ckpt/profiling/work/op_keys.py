"""How an op call inside a block is named, the same way torch's selective checkpointing counts it.

torch's selective checkpoint contexts (`torch.utils.checkpoint.create_selective_checkpoint_contexts`)
see every op below autograd as a dispatch mode, skip the ops in `SAC_IGNORED_OPS` (detach and a
few metadata ops, whose number differs between the forward and the recompute), and number the
calls of each op overload from 0 within one checkpointed region. An op-level plan keeps calls by
that name, so the profiler that measures them and the code that applies the plan must count
them identically: both use `OpCallCounter`. A selective block is a region of one block, so the
index is the call's position among the block's calls of the same op.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS

__all__ = ["OpCallCounter", "op_name", "is_random_op", "counted"]


_NAMES: dict[Any, str] = {}  # op overload -> its name (formatting it from the schema costs more than the op's count)
_RANDOM: dict[Any, bool] = {}  # op overload -> `is_random_op` (its tags never change)


def op_name(func: Any) -> str:
    """The name of an op overload in plans and tables: ``str(func)``, e.g. ``"aten.mm.default"``."""
    found = _NAMES.get(func)
    if found is None:
        found = _NAMES[func] = str(func)
    return found


def counted(func: Any) -> bool:
    """Whether selective checkpointing numbers calls of `func` (it skips `SAC_IGNORED_OPS`)."""
    return func not in SAC_IGNORED_OPS


def is_random_op(func: Any) -> bool:
    """Whether `func` draws random numbers (dropout's `bernoulli_`, `native_dropout`, `rand`...)."""
    found = _RANDOM.get(func)
    if found is None:
        found = _RANDOM[func] = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    return found


class OpCallCounter:
    """Numbers op calls as `(op_name(func), index among earlier calls of func)`.

    `key(func)` returns the next key for a call of `func` (and counts it), or None for an op
    selective checkpointing does not count. `reset()` starts a new region (a block's forward).
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = defaultdict(int)  # by `op_name`

    def reset(self) -> None:
        self._counts.clear()

    def key(self, func: Any) -> tuple[str, int] | None:
        return self.key_named(op_name(func)) if counted(func) else None

    def key_named(self, name: str) -> tuple[str, int]:
        """The next key for a call of the counted op named `name` (`op_name`: one name per overload)."""
        idx = self._counts[name]
        self._counts[name] = idx + 1
        return (name, idx)
