"""Stopping a pass before the op whose results would take it over the tracker's limit.

The tracker counts a storage once the op that made it returns, so a limit checked there lets that one op
go over. Near the limit (what is held plus twice a cheap bound on the op's results, or on the largest
storage made so far, above it), the op first runs on the meta device, which makes shapes and no memory,
and what its results would add is checked against the limit before the op itself runs. The bound reads
shapes only: the sizes of the inputs (and their sum: `cat`, gradients shaped as the inputs), the
broadcast of a pointwise op, a matrix product's rows by columns, an embedding's lookups; an op with no
tensor input (a factory) is always checked.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["bound_bytes", "result_bytes"]

_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul"})
_LOOKUPS = frozenset({"aten::embedding", "aten::index_select"})
_NO_META = frozenset({"aten::_local_scalar_dense", "aten::item"})  # read data: nothing to check, no meta kernel


_KINDS: dict[Any, int] = {}  # op overload -> how its results' size is read: 0 inputs, 1 broadcast, 2 matmul, 3 lookup


def _kind(func: Any) -> int:
    kind = _KINDS.get(func)
    if kind is None:
        name = getattr(getattr(func, "_schema", None), "name", "")
        pointwise = torch.Tag.pointwise in getattr(func, "tags", ())
        kind = _KINDS[func] = 1 if pointwise else 2 if name in _MATMULS else 3 if name in _LOOKUPS else 0
    return kind


def bound_bytes(func: Any, flat: list[torch.Tensor]) -> int | None:
    """A cheap guess of what op `func` on the tensors `flat` makes, from shapes; None when it has no tensor
    input (a factory: its sizes are in its other arguments)."""
    if not flat:
        return None
    guess = sum(t.numel() * t.element_size() for t in flat)  # (at least the largest: `cat`, gradients like inputs)
    kind = _kind(func)
    if kind == 1 and len(flat) > 1 and any(t.shape != flat[0].shape for t in flat):
        ndim = max(t.dim() for t in flat)
        numel = math.prod(max(t.shape[-i] if t.dim() >= i else 1 for t in flat) for i in range(1, ndim + 1))
        guess = max(guess, numel * max(t.element_size() for t in flat))  # the broadcast
    elif kind == 2 and len(flat) >= 2:
        a, b = flat[-2], flat[-1]
        if a.dim() >= 2 and b.dim() >= 2:
            guess = max(guess, math.prod(a.shape[:-1]) * b.shape[-1] * a.element_size())
    elif kind == 3 and len(flat) >= 2:
        weight, index = (flat[0], flat[1]) if func is torch.ops.aten.embedding.default else (flat[0], flat[-1])
        guess = max(guess, index.numel() * (weight.numel() // max(1, weight.shape[0])) * weight.element_size())
    return guess


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    return value


def result_bytes(func: Any, args: tuple, kwargs: dict | None) -> int | None:
    """The bytes of new storage op `func` would make on these arguments, found on the meta device (no
    memory, no mode sees it); None when that cannot be told (no meta kernel, tensors of a subclass)."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.name in _NO_META:
        return None
    if any(r.alias_info is not None for r in schema.returns):
        return 0  # a view or an in-place result: an input's storage
    try:
        with _disable_current_modes():
            out = func(*_meta(args), **_meta(kwargs or {}))
    except Exception:  # noqa: BLE001 - no meta kernel, or arguments it cannot take: checked after the op instead
        return None
    outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, (tuple, list)) else []
    return sum(t.untyped_storage().nbytes() for t in outs)
