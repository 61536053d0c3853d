"""What one rank holds of a parameter under tensor parallelism (DTensor), and its shard arithmetic.

A DTensor's `numel()` is its global size; the rank holds its local shard. `local_numel` and
`local_nbytes` size any parameter by the tensor this process holds (a plain tensor whole, a DTensor
with `Replicate` whole, with `Shard` its chunk, FSDP2 over tensor parallelism the chunk of the
chunk): what an optimizer's per-parameter state holds too, and a gradient unless it is a chunk of a
larger storage of its own (`grad_held_bytes`: the row-wise embedding's). `shard_shape` is torch's
chunking as arithmetic (`torch.chunk` per sharded mesh dimension, in mesh order): the first
coordinates get the larger chunks, so rank 0 holds the most of every uneven parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from lightning_ckpt.profiling.memory.tracker import local_tensor, storage_bytes, storage_key

__all__ = ["grad_held_bytes", "largest_shard_numel", "local_nbytes", "local_numel", "shard_shape"]


def local_numel(t: torch.Tensor) -> int:
    """Elements this process holds of `t` (a DTensor's local shard, else all of `t`)."""
    return local_tensor(t).numel()


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements this process holds of `t`, in `t`'s dtype."""
    return local_numel(t) * t.element_size()


def grad_held_bytes(params: Iterable[torch.Tensor]) -> dict[int, int]:
    """id(parameter) -> the bytes its gradient holds, for the trainable ones: the whole storage of a
    gradient that is the only one on it (the row-wise sharded embedding's is a chunk of the full
    vocabulary's gradient, which it keeps alive), else (no gradient yet, or views of one buffer:
    DDP's buckets, FSDP2's reduce-scatter output) its `local_nbytes`."""
    params = [p for p in params if p.requires_grad]
    owners: dict = {}
    for p in params:
        if p.grad is not None:
            owners.setdefault(storage_key(p.grad), set()).add(id(p))
    out = {}
    for p in params:
        key = None if p.grad is None else storage_key(p.grad)
        alone = key is not None and len(owners[key]) == 1
        out[id(p)] = max(storage_bytes(p.grad), local_nbytes(p)) if alone else local_nbytes(p)
    return out


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
