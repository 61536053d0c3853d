"""The shape of a batch, what varies between batches, and slices along what varies.

A batch's shape is its batch size and the shape of each of its tensors, in traversal order.
Two batches of one pipeline differ in a few positions (tensor, dimension): a padded sequence
length shows in every tensor that has it (input ids, attention mask, labels), an image size in
two dimensions. When every varying position has the same size within a batch, that size is the
batch's *length* and costs are fitted as polynomials in it (`planning.shape_profile`); slicing
every varying position to a shorter length (a prefix of each sequence) gives more lengths from
one batch. Positions whose sizes vary independently are separate axes (`axes_of`); a batch is then a
point, one size per axis, fitted over several axes (`planning.shape_grid`) and cropped per axis (`crop`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ckpt.profiling.structure.batch import batch_size_of, map_tensors, tensors_in

Position = tuple[int, int]  # (tensor index in traversal order, dimension)


@dataclass(frozen=True)
class BatchShape:
    """batch_size: samples in the batch; shapes: every tensor's shape, in traversal order."""

    batch_size: int
    shapes: tuple[tuple[int, ...], ...]

    def same_layout(self, other: "BatchShape") -> bool:
        """The same tensors with the same number of dimensions (sizes may differ)."""
        return len(self.shapes) == len(other.shapes) and all(len(a) == len(b) for a, b in zip(self.shapes, other.shapes))

    def size_at(self, position: Position) -> int:
        i, d = position
        return self.shapes[i][d]

    def with_batch_size(self, batch_size: int) -> "BatchShape":
        """The same shape at another batch size (each tensor's leading batch dimension resized)."""
        n = self.batch_size
        return BatchShape(batch_size, tuple(((batch_size, *s[1:]) if s and s[0] == n else s) for s in self.shapes))

    def describe(self) -> str:
        """E.g. ``batch 16, tensors [16, 128], [16, 128], [16]``."""
        tensors = ", ".join("[" + ", ".join(str(s) for s in shape) + "]" for shape in self.shapes)
        return f"batch {self.batch_size}, tensors {tensors or 'none'}"

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "shapes": [list(s) for s in self.shapes]}

    @classmethod
    def from_dict(cls, data: Any) -> "BatchShape":
        """The shape `to_dict` gave, or a ValueError saying what in `data` is not one."""

        def size(v: Any, least: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= least

        shapes = data.get("shapes") if isinstance(data, dict) else None
        if (
            not isinstance(data, dict) or set(data) != {"batch_size", "shapes"} or not size(data["batch_size"], 1)
            or not isinstance(shapes, (list, tuple))
            or not all(isinstance(s, (list, tuple)) and all(size(n, 0) for n in s) for s in shapes)
        ):
            raise ValueError(
                f"a batch shape is {{'batch_size': int >= 1, 'shapes': [[int >= 0, ...], ...]}} (one list per tensor), "
                f"got {data!r}."
            )
        return cls(data["batch_size"], tuple(tuple(s) for s in shapes))


def _gather(obj: Any, out: list[torch.Tensor]) -> None:
    """`out.extend(tensors_in(obj))`, with plain tuples, lists and dicts walked here (a batch read at every step)."""
    kind = type(obj)
    if kind is tuple or kind is list:
        for v in obj:
            _gather(v, out)
    elif kind is dict:
        for v in obj.values():
            _gather(v, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    else:  # any other container (a mapping, a dataclass, a namedtuple, ...) as `tensors_in` walks it
        out.extend(tensors_in(obj))


def shape_of(batch: Any) -> BatchShape:
    """The batch's shape (cheap: sizes only)."""
    tensors: list[torch.Tensor] = []
    _gather(batch, tensors)
    shapes = tuple(tuple(t.shape) for t in tensors)
    firsts = {s[0] for s in shapes if s}
    if len(firsts) == 1:  # every tensor with a dimension agrees (the common batch): no count needed
        return BatchShape(firsts.pop(), shapes)
    return BatchShape(batch_size_of(batch, tensors), shapes)


def varying_positions(shapes: Sequence[BatchShape]) -> tuple[Position, ...]:
    """Positions (tensor, dimension) whose size differs between any two of `shapes`, which share
    one layout; the batch dimension of a tensor that has it is left out (that is the batch size)."""
    first = shapes[0]
    found = []
    for i, dims in enumerate(first.shapes):
        for d in range(len(dims)):
            if d == 0 and dims[0] == first.batch_size:
                continue
            sizes = {s.shapes[i][d] for s in shapes}
            if len(sizes) > 1:
                found.append((i, d))
    return tuple(found)


def length_of(shape: BatchShape, positions: Sequence[Position]) -> int | None:
    """The size shared by all varying `positions` of `shape`; None when there are none or they differ."""
    sizes = {shape.size_at(p) for p in positions}
    return sizes.pop() if len(sizes) == 1 else None


def sequence_positions(shape: BatchShape) -> tuple[Position, ...]:
    """The token dimension of a batch of one sequence, found in that batch alone: the size of dimension 1
    most tensors of the batch (ids, labels, masks, position ids) share, at every dimension after the batch
    one of a per-sample tensor where it occurs; () when no per-sample tensor has a dimension 1."""
    n = shape.batch_size
    per_sample = [s for s in shape.shapes if len(s) >= 2 and s[0] == n]
    if not per_sample:
        return ()
    sizes = [s[1] for s in per_sample]
    length = max(sizes, key=sizes.count)
    return tuple(
        (i, d) for i, s in enumerate(shape.shapes) if len(s) >= 2 and s[0] == n for d in range(1, len(s)) if s[d] == length
    )


def _cumulative_index(t: torch.Tensor, length: int) -> bool:
    """Whether `t` is a 1-D integer index of where each packed example starts (`cu_seq_lens`): 0 first,
    `length` last, never decreasing."""
    if t.dim() != 1 or t.numel() < 2 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return False
    return int(t[0]) == 0 and int(t[-1]) == length and bool((t[1:] >= t[:-1]).all())


def slice_length(batch: Any, positions: Sequence[Position], length: int) -> Any:
    """The batch with every varying position cut to its first `length` entries (copied, so that
    the slice owns its memory), tensors elsewhere unchanged, but for an index of where packed
    examples start (`cu_seq_lens`: 0, ..., the full length), which is cut at `length` too."""
    by_tensor: dict[int, list[int]] = {}
    for i, d in positions:
        by_tensor.setdefault(i, []).append(d)
    index = iter(range(10**9))
    full = length_of(shape_of(batch), positions) if positions else None

    def cut(t: torch.Tensor) -> torch.Tensor:
        k = next(index)
        dims = by_tensor.get(k)
        if not dims:
            if full is not None and length < full and _cumulative_index(t, full):
                kept = t[t < length]
                return torch.cat([kept, kept.new_tensor([length])])
            return t
        for d in dims:
            t = t.narrow(d, 0, min(length, t.shape[d]))
        return t.clone()

    return map_tensors(batch, cut)


def shorter_lengths(length: int, known: Sequence[int], fractions: Sequence[float] = (0.5, 0.75)) -> list[int]:
    """Lengths to slice a batch of `length` down to, so that with it and the `known` lengths
    a quadratic can be fitted and checked: the given fractions of it, not already known."""
    out = []
    for f in fractions:
        x = max(1, int(round(length * f)))
        if x < length and x not in known and x not in out:
            out.append(x)
    return sorted(out)


Axes = tuple[tuple[Position, ...], ...]  # varying positions grouped: the positions of one axis always share a size


def axes_of(shapes: Sequence[BatchShape], positions: Sequence[Position]) -> Axes:
    """`positions` grouped into independent sizes: two positions are one axis when they have the same size in
    every one of `shapes` (the sequence length of ids, mask and labels), apart otherwise (an image's height
    and width, once one batch is not square)."""
    groups: dict[tuple[int, ...], list[Position]] = {}
    for p in positions:
        groups.setdefault(tuple(s.size_at(p) for s in shapes), []).append(p)
    return tuple(tuple(g) for g in groups.values())


def point_of(shape: BatchShape, axes: Axes) -> tuple[int, ...] | None:
    """`shape`'s size on each axis; None when the positions of one axis differ in it."""
    out = []
    for axis in axes:
        sizes = {shape.size_at(p) for p in axis}
        if len(sizes) != 1:
            return None
        out.append(sizes.pop())
    return tuple(out)


def alignment(sizes: Sequence[int], most: int = 8) -> int:
    """The largest power of two, at most `most`, that divides every size seen on an axis: crops keep it, so
    that strided stages round a crop as they round the real batches."""
    g = 0
    for n in sizes:
        g = math.gcd(g, n)
    a = 1
    while a < most and g and g % (2 * a) == 0:
        a *= 2
    return a


def crop_points(point: Sequence[int], aligned: Sequence[int]) -> list[tuple[int, ...]]:
    """Smaller points to crop a batch at `point` to, so that a fit over several sizes can be made and checked:
    all halved, then each axis halved alone (each rounded to its axis's alignment), distinct, not the point.
    The first reaches lowest on every axis at once: the sizes below the smallest profiled are costed raised to
    it (`planning.shape_grid`), so one crop that fits the model leaves the fewest sizes over-counted."""
    def half(i: int) -> int:
        a = aligned[i]
        return max(a, int(point[i] / 2 / a + 0.5) * a)

    out: list[tuple[int, ...]] = [tuple(half(j) for j in range(len(point)))]
    for i in range(len(point)):
        out.append(tuple(half(j) if j == i else n for j, n in enumerate(point)))
    seen = {tuple(point)}
    return [p for p in out if not (p in seen or seen.add(p))]


def crop(batch: Any, axes: Axes, point: Sequence[int]) -> Any:
    """The batch with every position of each axis cut to its first `point[axis]` entries, or, where the batch
    has fewer, grown to them with its own entries repeated (real values: pixels, token ids, mask bits), copied
    so that the result owns its memory; tensors without a varying position are passed on as they are."""
    by_tensor: dict[int, list[tuple[int, int]]] = {}
    for axis, n in zip(axes, point):
        for i, d in axis:
            by_tensor.setdefault(i, []).append((d, n))
    index = iter(range(10**9))

    def cut(t: torch.Tensor) -> torch.Tensor:
        dims = by_tensor.get(next(index))
        if not dims:
            return t
        for d, n in dims:
            if n > t.shape[d] > 0:
                t = t.repeat(*(-(-n // t.shape[d]) if k == d else 1 for k in range(t.dim())))
            t = t.narrow(d, 0, min(n, t.shape[d]))
        return t.clone()

    return map_tensors(batch, cut)
