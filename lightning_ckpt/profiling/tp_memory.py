"""What one rank holds of a parameter under tensor parallelism (DTensor), and its shard arithmetic.

A DTensor's `numel()` is its global size; the rank holds its local shard. `local_numel` and
`local_nbytes` size any parameter by the tensor this process holds (a plain tensor whole, a DTensor
with `Replicate` whole, with `Shard` its chunk, FSDP2 over tensor parallelism the chunk of the
chunk): what its gradient and an optimizer's per-parameter state hold too. `shard_shape` is torch's
chunking as arithmetic (`torch.chunk` per sharded mesh dimension, in mesh order): the first
coordinates get the larger chunks, so rank 0 holds the most of every uneven parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_ckpt.profiling.tracker import local_tensor

__all__ = ["largest_shard_numel", "local_nbytes", "local_numel", "shard_shape"]


def local_numel(t: torch.Tensor) -> int:
    """Elements this process holds of `t` (a DTensor's local shard, else all of `t`)."""
    return local_tensor(t).numel()


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements this process holds of `t`, in `t`'s dtype."""
    return local_numel(t) * t.element_size()


def _chunk(size: int, parts: int, index: int) -> int:
    """Length of chunk `index` when `torch.chunk` splits `size` into `parts` (0 past the end)."""
    step = -(-size // parts) if size else 0
    return max(0, min(step, size - index * step)) if step else 0


def shard_shape(
    global_shape: Sequence[int], mesh_shape: Sequence[int], shard_dims: Sequence[int | None], coordinate: Sequence[int]
) -> tuple[int, ...]:
    """The local shape at `coordinate` of the mesh: for each mesh dimension the tensor dimension it
    shards (`Shard(d).dim`), or None for `Replicate` and `Partial`, which keep the whole size."""
    if not (len(mesh_shape) == len(shard_dims) == len(coordinate)):
        raise ValueError(
            f"mesh_shape {tuple(mesh_shape)}, shard_dims {tuple(shard_dims)} and coordinate {tuple(coordinate)} "
            "must have one entry per mesh dimension."
        )
    shape = list(global_shape)
    for parts, dim, index in zip(mesh_shape, shard_dims, coordinate):
        if dim is None:
            continue
        if not -len(shape) <= dim < len(shape) or not 0 <= index < parts:
            raise ValueError(
                f"Shard({dim}) at mesh index {index} of {parts} does not fit a tensor of shape {tuple(global_shape)}; "
                "the dimension must exist and the index lie on the mesh."
            )
        shape[dim] = _chunk(shape[dim], parts, index)
    return tuple(shape)


def largest_shard_numel(global_shape: Sequence[int], mesh_shape: Sequence[int], shard_dims: Sequence[int | None]) -> int:
    """The most elements any rank of the mesh holds (that of coordinate 0: chunks shrink along the mesh)."""
    return _numel(shard_shape(global_shape, mesh_shape, shard_dims, [0] * len(mesh_shape)))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
