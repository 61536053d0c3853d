"""Batches as the profiler sees them: their size, the first `n` samples, their tensors."""

from __future__ import annotations

from typing import Any

import torch


def batch_size_of(batch: Any) -> int:
    """The leading dimension shared by the batch's tensors."""
    sizes = {t.shape[0] for t in tensors_in(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"cannot tell the batch size: the batch's tensors have leading dimensions {sorted(sizes)}; "
            "lightning-ckpt slices batches along dimension 0, so every tensor in the batch needs the same one."
        )
    return sizes.pop()


def slice_batch(batch: Any, n: int) -> Any:
    """The first `n` samples of a batch (tensors, tuples, lists, dicts, nested), copied."""
    if isinstance(batch, torch.Tensor):
        # a copy, not a view: a view keeps (and measures as) the whole batch's storage
        return batch[:n].clone() if batch.dim() > 0 else batch
    if isinstance(batch, dict):
        return type(batch)((k, slice_batch(v, n)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, n) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, n) for v in batch)
    return batch


def tensors_in(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def first_tensor(obj: Any) -> torch.Tensor | None:
    return next(iter(tensors_in(obj)), None)
