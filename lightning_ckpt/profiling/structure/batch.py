"""Batches as the profiler sees them: their size, the first `n` samples, their tensors.

A batch is anything a Lightning loader yields: tensors, and tuples, lists, namedtuples, mappings
(`dict`, `UserDict` such as transformers' `BatchEncoding`) and dataclasses (frozen or not) of them,
nested. Its size is the leading dimension shared by the most tensors of dim >= 1; scalars and
tensors with another leading dimension (a mask shared by all samples, a table) are not per-sample.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter, UserDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection, is_dataclass_instance


def batch_size_of(batch: Any, tensors: list[torch.Tensor] | None = None) -> int:
    """The leading dimension shared by the most tensors of dim >= 1 (ties: the first such tensor's);
    `tensors`: the batch's `tensors_in`, when the caller has them already."""
    tensors = list(tensors_in(batch)) if tensors is None else tensors
    sizes = Counter(t.shape[0] for t in tensors if t.dim() > 0)
    if not sizes:
        scalars = len(tensors)
        held = f"only {scalars} scalar tensor(s)" if scalars else "no tensors at all"
        raise ValueError(
            f"cannot tell the batch size: the batch is a {type(batch).__name__} that holds no tensor with a batch "
            f"dimension ({held}). lightning-ckpt slices a batch along dimension 0 of its tensors, so the train "
            "loader must yield tensors of shape [batch, ...], or tuples, lists, dicts or dataclasses of them."
        )
    return max(sizes, key=sizes.__getitem__)  # a Counter keeps first-seen order and max the first maximum


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors that carry the batch dimension: those `slice_batch` slices, in traversal order."""
    n = batch_size_of(batch)
    return [t for t in tensors_in(batch) if _is_per_sample(t, n)]


def slice_batch(batch: Any, n: int) -> Any:
    """The first `n` samples of a batch, as an object of the batch's own type.

    Tensors that carry the batch dimension are copied, not viewed: a view keeps (and measures as)
    the whole batch's storage. Scalars, other tensors and non-tensor values are passed on as they are.
    """
    size = batch_size_of(batch)
    if not 1 <= n <= size:
        raise ValueError(f"cannot slice {n} samples from a batch of {size}; give 1 <= n <= {size}.")
    return _rebuild(batch, lambda t: t[:n].clone() if _is_per_sample(t, size) else t)


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `obj`, lazily, in the order `slice_batch` rebuilds them: items, fields, elements."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, UserDict):
        yield from tensors_in(obj.data)
    elif is_dataclass_instance(obj):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name))
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):  # namedtuples included
        for v in obj:
            yield from tensors_in(v)


def first_tensor(obj: Any) -> torch.Tensor | None:
    return next(tensors_in(obj), None)


def _is_per_sample(t: torch.Tensor, batch_size: int) -> bool:
    return t.dim() > 0 and t.shape[0] == batch_size


class _OwnNodeType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (torch.Tensor, UserDict)) or is_dataclass_instance(obj)


class _OwnNode(metaclass=_OwnNodeType):
    """What `apply_to_collection` hands to `_rebuild_node` instead of rebuilding it: tensors, UserDicts
    (it would rebuild them from their items alone, so a BatchEncoding would lose its other attributes)
    and dataclass instances (it deep-copies them and cannot set the fields of frozen ones)."""


def _rebuild(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with every tensor `t` replaced by `fn(t)`, each container rebuilt as its own type."""
    return apply_to_collection(obj, _OwnNode, _rebuild_node, fn)


def _rebuild_node(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    new = copy.copy(obj)  # the same type, with every attribute that is neither an item nor a field
    if isinstance(obj, UserDict):
        new.data = _rebuild(obj.data, fn)
        return new
    frozen = type(obj).__dataclass_params__.frozen
    for field in dataclasses.fields(obj):
        value = _rebuild(getattr(obj, field.name), fn)
        # setattr keeps a dataclass that is also a mapping (HF ModelOutput) in step with its items
        (object.__setattr__ if frozen else setattr)(new, field.name, value)
    cached = getattr(new, "__dict__", {})
    for klass in type(obj).__mro__:  # values cached from the whole batch do not describe the slice
        for name, attr in vars(klass).items():
            if isinstance(attr, cached_property):
                cached.pop(name, None)
    return new


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`batch` rebuilt as its own type with every tensor `t` replaced by `fn(t)`, called once per
    tensor in the order `tensors_in` yields them."""
    return _rebuild(batch, fn)


def checked_size(
    batch: Any, probes: tuple[int, int], check: int | None, info: Callable[[str], None], what: str = "the batch"
) -> int | None:
    """The probe sizes checked against `what` they slice; -> the check size to use (None: skip it)."""
    n = batch_size_of(batch)
    if n == 1:  # one sample: profiled whole, and along its tokens (prefixes), not on slices of samples
        return None
    if max(probes) > n:
        raise ValueError(
            f"probe_batch_sizes={probes} but {what} has {n} samples; the probes are slices of that batch. "
            f"Set probe_batch_sizes to two sizes <= {n}, e.g. (1, 2)."
        )
    if check is not None and check > n:
        info(
            f"lightning-ckpt: check_batch_size={check} is larger than {what} ({n} samples), so the fitted "
            f"line is not checked; set check_batch_size <= {n} to check it, or None to silence this."
        )
        return None
    return check
