"""The shapes of one batch layout seen so far and the profiles made at some of them, and how a new shape
of that layout is costed from them: its own profile, the fit in one varying length
(`planning.shape_profile`) or in several independent sizes (`planning.shape_grid`), inside the profiled
sizes or a little past them with a checked reserve, or the profile of a slightly larger shape.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.engine.length_profiles import EXTRAPOLATE, GROW, extrapolated
from lightning_ckpt.planning.cost_combination import with_pre_saved
from lightning_ckpt.planning.shape_grid import GridProfile, Reach
from lightning_ckpt.planning.shape_profile import FIT_TOLERANCE, ShapeProfile, checked_bytes
from lightning_ckpt.profiling.structure.shapes import BatchShape, alignment, axes_of, length_of, point_of, varying_positions
from lightning_ckpt.units import format_bytes

BUCKET = 0.125  # a profiled shape up to this much larger in every varying size may stand in for a new one

SampleKey = tuple[tuple[int, ...], ...]
CostOf = Callable[..., StepCost]  # (batch_size, **step fields) -> StepCost


def sample_key(shape: BatchShape) -> SampleKey:
    """The shape without its batch size: the batch dimension of each tensor that has it is -1."""
    return tuple(((-1, *s[1:]) if s and s[0] == shape.batch_size else s) for s in shape.shapes)


def layout_key(shape: BatchShape) -> tuple[int, ...]:
    return tuple(len(s) for s in shape.shapes)


def family_key(shape: BatchShape, one_sample: bool) -> tuple[int, ...]:
    """The key of `shape`'s family: its layout, and apart from the lines in the batch size, the profiles of
    batches of one sample (at batch size 1 only, `Profile.one_size`), which cannot cost other batch sizes."""
    return (*layout_key(shape), -1) if one_sample else layout_key(shape)


@dataclass
class ShapeFamily:
    """The shapes of one layout seen so far and the profiles made at some of them: on real batches
    (`own`) or on prefixes of them at shorter lengths, which only ever feed the fit."""

    seen: dict[SampleKey, BatchShape] = field(default_factory=dict)
    tokens: tuple[tuple[int, int], ...] = ()  # the token dimension of a first batch of one sample, found in it alone
    profiles: dict[SampleKey, tuple[BatchShape, Profile, bool]] = field(default_factory=dict)
    # own only, "grid", "layout" -> (what it was built from, the ShapeProfile, GridProfile or (positions, axes))
    _fitted: dict = field(default_factory=dict, repr=False)

    def positions(self) -> tuple[tuple[int, int], ...]:
        return self._layout()[0]

    def axes(self) -> tuple:
        """The varying positions grouped into independent sizes (`profiling.structure.shapes.axes_of`)."""
        return self._layout()[1]

    def _layout(self) -> tuple[tuple, tuple]:
        """(positions, axes), found again only when a shape or the tokens changed: costing one shape asks
        for them several times, and each pass reads every shape seen. Shapes only added to `seen` since
        (each new shape of a run) refine the last answer (`_refined`) instead of reading every shape again."""
        seen = list(self.seen.values())
        profiled = [s for s, _, _ in self.profiles.values()]
        key = (seen, profiled, self.tokens)
        cached = self._fitted.get("layout")
        if cached is not None:
            (was_seen, was_profiled, was_tokens), found, columns = cached
            if was_profiled == profiled and was_tokens == self.tokens and seen[: len(was_seen)] == was_seen:
                if len(seen) == len(was_seen):
                    return found
                grown = None if columns is None else _refined(columns, seen[len(was_seen):])
                if grown is not None:
                    self._fitted["layout"] = (key, *grown)
                    return grown[0]
        shapes = seen + profiled
        positions = (varying_positions(shapes) if len(shapes) > 1 else ()) or self.tokens
        found = (positions, axes_of(shapes, positions))
        self._fitted["layout"] = (key, found, _columns(shapes) if seen else None)
        return found

    def length(self, shape: BatchShape) -> int | None:
        """`shape`'s size in the one varying length; None when nothing varies or several sizes vary apart."""
        positions, axes = self._layout()
        if not positions or len(axes) > 1:
            return None
        return length_of(shape, positions)

    def point(self, shape: BatchShape) -> tuple[int, ...] | None:
        """`shape`'s size on each axis when several vary apart (the height and the width); else None."""
        axes = self.axes()
        return point_of(shape, axes) if len(axes) > 1 else None

    def aligned(self) -> tuple[int, ...]:
        """Per axis, the power of two (at most 8) every size seen on it shares: crops are cut to it."""
        shapes = list(self.seen.values())
        return tuple(alignment([s.size_at(axis[0]) for s in shapes]) for axis in self.axes())

    def grid(self) -> GridProfile | None:
        """The profiles (real batches and crops of them) as a function of the sizes on every axis; None
        with fewer than two axes."""
        return self._grid(self.axes())

    def _grid(self, axes: tuple) -> GridProfile | None:
        key = ("grid", tuple(self.profiles), axes)
        cached = self._fitted.get("grid")
        if cached is None or cached[0] != key:
            points = {}
            for shape, profile, _ in self.profiles.values():
                p = point_of(shape, axes) if len(axes) > 1 else None
                if p is not None and not profile.one_size:
                    points[p] = profile
            grid = GridProfile(tuple(sorted(points.items()))) if len(points) > 1 else None
            self._fitted["grid"] = cached = (key, grid)
        return cached[1]

    def grid_reach(self, shape: BatchShape) -> tuple[GridProfile, Reach] | None:
        """How the fit over several sizes costs `shape`, when it can."""
        return self._grid_reach(shape, self.axes())

    def _grid_reach(self, shape: BatchShape, axes: tuple) -> tuple[GridProfile, Reach] | None:
        p = point_of(shape, axes) if len(axes) > 1 else None
        grid = self._grid(axes)
        reach = None if p is None or grid is None else grid.reach(p, shape.batch_size)
        return None if reach is None else (grid, reach)

    def shape_profile(self, own_only: bool = False) -> ShapeProfile | None:
        """The profiles (real batches only, with `own_only`) as a function of the one varying length;
        None when the varying sizes are not one length (or nothing varies)."""
        key = (tuple(self.profiles), self.positions())  # a shape seen again changes neither
        cached = self._fitted.get(own_only)
        if cached is None or cached[0] != key:
            self._fitted[own_only] = cached = (key, self._shape_profile(own_only))
        return cached[1]

    def _shape_profile(self, own_only: bool) -> ShapeProfile | None:
        positions = self.positions()
        if not positions or len(self.axes()) > 1:
            return None
        by_length: dict[int, Profile] = {}
        for shape, profile, own in self.profiles.values():
            x = length_of(shape, positions)
            if x is None:
                return None
            if own or not own_only:
                by_length[x] = profile
        return ShapeProfile(tuple(sorted(by_length.items()))) if by_length else None

    def cost_of(self, shape: BatchShape) -> tuple[CostOf, str] | None:
        """How to cost steps at `shape` from what was profiled, and from what ('profiled', 'fitted
        ...' or 'bounded by <shape>'); None when nothing here can."""
        exact = self.profiles.get(sample_key(shape))
        if exact is not None and exact[2]:
            return exact[1].at, "profiled"
        positions, axes = self._layout()  # as `length` and `grid_reach` read them: nothing below changes them
        x = length_of(shape, positions) if positions and len(axes) <= 1 else None
        if x is not None:
            for own_only in (False, True):  # prefixes can differ from real batches (no padding left in them)
                fitted = self.shape_profile(own_only)
                if fitted is not None and fitted.covers(x, shape.batch_size):
                    lengths = ", ".join(map(str, fitted.lengths))
                    err = fitted.fit_error(shape.batch_size) or 0.0
                    held = fitted.transient_miss_bytes(shape.batch_size) or 0
                    source = (
                        f"fitted over lengths {lengths} (checked within {100 * err:.2f} %, held in reserve with "
                        f"{format_bytes(held)} for the transients)"
                    )
                    return functools.partial(_with_reserve, fitted, x, err, held), source
        if x is not None:  # past the longest profiled length: one sample far, larger batches a little
            one = shape.batch_size == 1
            for own_only in (False,) if one else (False, True):
                found = extrapolated(self.shape_profile(own_only), x, shape.batch_size, EXTRAPOLATE if one else GROW)
                if found is not None:
                    return found
        reached = self._grid_reach(shape, axes)
        if reached is not None:
            grid, reach = reached
            sizes = " x ".join(map(str, reach.point))
            where = f"extrapolated {reach.stretch:.2f}x past" if reach.extrapolated else "fitted within"
            source = (
                f"{where} {len(grid.points)} profiled sizes at {sizes} ({reach.model}; checked within "
                f"{100 * reach.error:.2f} %, {100 * reach.reserve_share:.2f} % and {format_bytes(reach.transient_bytes)} "
                "for the transients held in reserve)"
            )
            return functools.partial(_grid_cost, grid, reach), source
        own_shapes = [s for s, _, own in self.profiles.values() if own]
        bound = _bounding(shape, own_shapes, positions)
        if bound is not None:
            return self.profiles[sample_key(bound)][1].at, f"bounded by the profile at {bound.describe()}"
        return None

    def prefixes_misfit(self, batch_size: int) -> bool:
        """Whether the prefixes disagree with the real batches: the fit over all profiles fails its
        check while there are prefixes in it."""
        if all(own for _, _, own in self.profiles.values()):
            return False
        fitted = self.shape_profile()
        err = None if fitted is None else fitted.fit_error(batch_size)
        return err is not None and err > FIT_TOLERANCE


# What `_refined` carries from one answer of `ShapeFamily._layout` to the next: the first shape (whose batch
# dimensions are left out), every other position of its layout, and for each position whose size varies a
# label that two positions share exactly when their sizes agree in every shape so far (`axes_of`'s grouping).
Columns = tuple[BatchShape, tuple[tuple[int, int], ...], dict]


def _columns(shapes: list[BatchShape]) -> Columns | None:
    """The labels of `shapes` (`Columns`), read from all of them; None when their layouts differ."""
    first = shapes[0]
    if any(not first.same_layout(s) for s in shapes):
        return None
    candidates = tuple(  # every position `varying_positions` reads: the batch dimensions left out
        (i, d) for i, dims in enumerate(first.shapes) for d in range(len(dims))
        if not (d == 0 and dims[0] == first.batch_size)
    )
    ids: dict[tuple[int, ...], int] = {}
    labels = {}
    for i, d in candidates:
        column = tuple(s.shapes[i][d] for s in shapes)
        if len(set(column)) > 1:
            labels[(i, d)] = ids.setdefault(column, len(ids))
    return first, candidates, labels


def _refined(columns: Columns, added: list[BatchShape]) -> tuple[tuple[tuple, tuple], Columns] | None:
    """((positions, axes), the labels) with `added` shapes joining those `columns` were read from: the answer of
    `varying_positions` and `axes_of` over all of them, each added shape read once. A position varies once a shape
    differs from the first there; a label splits by the added shape's size. None when there is no varying
    position (the tokens stand in then) or an added shape has another layout: the caller reads every shape."""
    first, candidates, labels = columns
    for s in added:
        if not first.same_layout(s):
            return None
        ids: dict[tuple, int] = {}
        split = {}
        for p in candidates:
            i, d = p
            n = s.shapes[i][d]
            label = labels.get(p)
            if label is not None:  # varying already: the same label while the sizes agree here too
                split[p] = ids.setdefault((label, n), len(ids))
            elif n != first.shapes[i][d]:  # the same size in every shape until this one
                split[p] = ids.setdefault((None, first.shapes[i][d], n), len(ids))
        labels = split
    positions = tuple(p for p in candidates if p in labels)
    if not positions:
        return None
    groups: dict[int, list[tuple[int, int]]] = {}
    for p in positions:
        groups.setdefault(labels[p], []).append(p)
    return (positions, tuple(tuple(g) for g in groups.values())), (first, candidates, labels)


def _grid_cost(grid: GridProfile, reach: Reach, batch_size: int, **step_fields) -> StepCost:
    return grid.cost(reach, batch_size, **step_fields)


def cost_key(cost_of: CostOf) -> tuple | None:
    """What a cost from a fit over several sizes depends on (`GridProfile.cost_key`): costs of equal keys are
    equal at every batch size. None for the others (a profile's own, a fit in one length: a shape each)."""
    if isinstance(cost_of, functools.partial) and cost_of.func is _grid_cost:
        grid, reach = cost_of.args
        return grid.cost_key(reach)
    return None


def _with_reserve(
    fitted: ShapeProfile, length: int, err: float, transient_bytes: int, batch_size: int, **step_fields
) -> StepCost:
    """The fitted cost with the fit's checked miss (a share of the checked bytes, and the transients' in bytes:
    `ShapeProfile.transient_miss_bytes`) held as resident bytes before the chain, so that a plan made from it
    fits even when the fit is off by that much."""
    cost = fitted.at(batch_size, length, **step_fields)
    reserve = int(math.ceil(err * sum(checked_bytes(cost)))) + transient_bytes
    return with_pre_saved(cost, reserve)


def _bounding(shape: BatchShape, profiled: list[BatchShape], positions) -> BatchShape | None:
    """The smallest profiled shape that is at least as large as `shape` at every varying position
    and at most `BUCKET` larger; equal elsewhere."""
    best, best_size = None, None
    for cand in profiled:
        if sample_key(cand) == sample_key(shape):
            return cand
        ok, size = True, 1
        for i, dims in enumerate(shape.shapes):
            for d, n in enumerate(dims):
                if d == 0 and n == shape.batch_size and cand.shapes[i][0] == cand.batch_size:
                    continue
                m = cand.shapes[i][d]
                if (i, d) in positions:
                    ok &= n <= m <= n * (1 + BUCKET)
                    size *= m
                else:
                    ok &= m == n
        if ok and (best_size is None or size < best_size):
            best, best_size = cand, size
    return best
