"""A plan per batch shape, cached, with profiling bounded as batches of new shapes arrive.

Batches of one pipeline share a layout (the same tensors with the same number of dimensions)
and differ in a few sizes: the batch size and, with dynamic padding, a length. For each batch
`ShapePlans.plan_for` finds the step's cost at that shape from what was profiled before, and
plans it once:

1. a profiled shape: its own profile (a line in the batch size);
2. the fit in one varying length or in several sizes that vary apart (`engine.shape_family`), inside the
   profiled sizes or a little past them, with the checked miss held in reserve;
3. a profiled shape at most `BUCKET` larger at every varying size: that shape's profile;
4. otherwise the batch itself is profiled on slices of its own samples and, until the fit passes its
   check, on prefixes (one length) or crops (several sizes) of it, so that later shapes are fitted; a batch a
   little past the sizes of a checked fit over several sizes is grown instead (its own entries repeated) to
   the point that reaches as far on every axis (`planning.shape_grid.grown_point`), when that pass is
   predicted to fit the budget, and profiled there, once for the shapes out as far on the other axes.

Plans are kept for the most recently used shapes (`engine.plan_cache`).
Profiling and planning are injected (`profile_fn`, `plan_fn`): the engine is plain Python
over shapes and profiles, the same under every front end. Nothing here runs a step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.units import format_bytes
from lightning_ckpt.planning.shape_profile import FIT_TOLERANCE
from lightning_ckpt.engine.length_profiles import longest_by_prefixes, longest_length, profile_lengths, too_long
from lightning_ckpt.engine.plan_cache import PlanCache
from lightning_ckpt.engine.shape_family import (  # noqa: F401 - BUCKET and sample_key are read from here too
    BUCKET,
    CostOf,
    SampleKey,
    ShapeFamily,
    family_key,
    layout_key,
    sample_key,
)
from lightning_ckpt.planning.shape_grid import grown_point
from lightning_ckpt.costs.budget_error import InfeasibleBudgetError
from lightning_ckpt.profiling.passes.profile_budget import MARGIN, SampleTooLong
from lightning_ckpt.profiling.passes.profile_refusal import Shortfall
from lightning_ckpt.profiling.structure.shapes import (
    BatchShape,
    crop,
    crop_points,
    sequence_positions,
    shape_of,
    shorter_lengths,
    slice_length,
)


@dataclass(frozen=True)
class ShapeDecision:
    """The plan for one batch shape and how it was found."""

    shape: BatchShape
    plan: Plan
    source: str  # 'profiled', 'fitted' or 'bounded by ...'
    new: bool  # planned now (False: from the cache)
    profiled_lengths: tuple[int, ...] = ()  # lengths profiled for it (the batch's own first)
    profile_s: float = 0.0
    plan_s: float = 0.0


def met_again(decision: ShapeDecision) -> ShapeDecision:
    """A cached decision as a later batch of its shape meets it (`new` False): `dataclasses.replace(decision,
    new=False)`, made directly (a step of a shape seen before costs little more than this), or the decision
    itself when it says so already."""
    if not decision.new:
        return decision
    return ShapeDecision(decision.shape, decision.plan, decision.source, False, decision.profiled_lengths,
                         decision.profile_s, decision.plan_s)


ProfileFn = Callable[[Any, bool], Profile]  # (batch, is its own shape) -> Profile
PlanFn = Callable[[CostOf, BatchShape], Plan]
MAX_GRID_POINTS = 12  # crops are cut only while a fit over several sizes has fewer points than this


class ShapePlans:
    """Plans per shape (`plan_for`), profiles per family of shapes, and what it all cost."""

    def __init__(
        self, profile_fn: ProfileFn, plan_fn: PlanFn, slice_lengths: bool = True, room_fn: Callable[[Any], int | None] | None = None,
    ) -> None:
        self.profile_fn, self.plan_fn, self.slice_lengths = profile_fn, plan_fn, slice_lengths
        self.room_fn = room_fn  # (batch) -> the bytes a profiling pass may hold beside it (None: not known)
        # whether a batch may be profiled grown (`_profile_corner`): one process only, as the prediction that
        # decides it reads this process's bytes, and ranks that profile must all run the same passes
        self.grow_corners = False
        self.families: dict[tuple[int, ...], ShapeFamily] = {}
        self.plans: PlanCache = PlanCache()  # (shape without its batch size, batch size) -> ShapeDecision, bounded
        self.slice_error: str | None = None  # why prefixes of batches stopped being profiled
        self.whole_shortfall: Shortfall | None = None  # what the pass on a whole sample measured when it was stopped
        self.profile_runs = 0  # profiles made (each a few small steps)
        self.profile_s = 0.0
        self.plan_s = 0.0

    def forget_plans(self) -> None:
        """Drop the cached plans (a new budget, static memory or setting), keep the profiles."""
        self.plans.clear()

    def forget(self, shape: BatchShape) -> ShapeDecision | None:
        """Drop the cached plan of `shape` (its budget changed), keep the profiles; -> what was cached."""
        return self.plans.pop((sample_key(shape), shape.batch_size), None)

    def add_profile(self, shape: BatchShape, profile: Profile) -> None:
        """Register a profile made elsewhere (a resumed run's) at `shape`."""
        family = self.families.setdefault(family_key(shape, profile.one_size), ShapeFamily())
        family.seen.setdefault(sample_key(shape), shape)
        family.profiles[sample_key(shape)] = (shape, profile, True)


    @property
    def profiled_shapes(self) -> list[BatchShape]:
        return [s for f in self.families.values() for s, _, own in f.profiles.values() if own]

    def cached(self, shape: BatchShape) -> ShapeDecision | None:
        return self.plans.used((sample_key(shape), shape.batch_size))

    def is_cached(self, shape: BatchShape) -> bool:
        """Whether `shape`'s plan is cached (its use left as it was)."""
        return (sample_key(shape), shape.batch_size) in self.plans

    def plan_for(self, batch: Any, shape: BatchShape | None = None) -> ShapeDecision:
        """The plan for `batch`'s shape: cached, or costed (profiling the batch when needed) and planned."""
        shape = shape_of(batch) if shape is None else shape
        hit = self.cached(shape)
        if hit is not None:
            return met_again(hit)
        family = self.families.get(layout_key(shape)) if shape.batch_size == 1 else None
        if family is not None:  # one sample: the lines of larger batches cost it when they can
            family.seen.setdefault(sample_key(shape), shape)
        found = None if family is None else family.cost_of(shape)
        if found is None:
            family = self.families.setdefault(family_key(shape, shape.batch_size == 1), ShapeFamily())
            family.seen.setdefault(sample_key(shape), shape)
            found = family.cost_of(shape)
        lengths: tuple[int, ...] = ()
        longest = None
        t0 = time.perf_counter()
        if found is None and batch is None:
            raise ValueError(
                f"no profile covers the batch shape ({shape.describe()}), the largest of the ranks' batches, and no "
                "rank holds a batch of exactly that shape to profile: the ranks' batches differ in more than one "
                "size. Pad every rank's batches to a common length (e.g. a fixed max_length, or pad_to_multiple_of "
                "in the collator with lengths grouped across ranks), or train on one process."
            )
        if found is None:
            self.whole_shortfall = None
            try:
                lengths = self._profile(family, batch, shape)
            except SampleTooLong as err:  # one sample no pass fits, its prefixes not cut: refused with the numbers
                raise too_long(shape, family.length(shape), (), self.slice_error, err.shortfall) from None
            found = family.cost_of(shape)
            if found is None and self.whole_shortfall is not None and self.slice_lengths:  # the longest prefix that fits
                longest = longest_by_prefixes(family.length(shape), lengths, self._prefix_profiler(family, batch, shape))
                lengths = tuple(sorted({*lengths, *longest[2]}))
                found = family.cost_of(shape)  # (its profiles may be enough for the fit to cost the whole)
            if found is None:  # one sample too long to profile whole, and its prefixes too few to fit
                raise self._too_long(family, shape, lengths, longest)
        profile_s = time.perf_counter() - t0
        cost_of, source = found
        t1 = time.perf_counter()
        try:
            plan = self.plan_fn(cost_of, shape)
        except InfeasibleBudgetError:
            if longest is None:
                raise
            raise self._too_long(family, shape, lengths, longest, planned=True) from None  # (with what was measured)
        plan_s = time.perf_counter() - t1
        self.profile_s += profile_s
        self.plan_s += plan_s
        decision = ShapeDecision(shape, plan, source, True, lengths, profile_s, plan_s)
        self.plans[(sample_key(shape), shape.batch_size)] = decision
        return decision

    def longest_length(self, shape: BatchShape, fits: Callable[[CostOf, BatchShape], bool]) -> int | None:
        """The longest length of `shape`'s varying dimension whose step `fits`, from what was profiled
        (`engine.length_profiles.longest_length`); None when its family was never fitted in a length."""
        family = self.families.get(family_key(shape, shape.batch_size == 1))
        return None if family is None else longest_length(family, shape, fits)

    def profile_own(self, batch: Any, shape: BatchShape) -> Profile:
        """Profile `batch` at its own shape and register it (no prefixes, no plan)."""
        profile = self.profile_fn(batch, True)
        self.add_profile(shape, profile)
        self.profile_runs += 1
        return profile

    def settle(self, shape: BatchShape, plan: Plan) -> ShapeDecision:
        """The decision at `shape` with `plan` (rank 0's, as every rank applies it), cached."""
        key = (sample_key(shape), shape.batch_size)
        decision = self.plans.get(key)
        if decision is None:
            decision = ShapeDecision(shape, plan, "profiled", True)
        elif decision.plan is not plan:  # one process: the very plan `plan_for` cached, kept as it is
            decision = dataclasses.replace(decision, plan=plan)
        self.plans[key] = decision
        return decision

    def _profile(self, family: ShapeFamily, batch: Any, shape: BatchShape) -> tuple[int, ...]:
        """Profile the batch at its own shape and, when one length varies, at shorter prefixes. A batch of
        one sample is profiled along its tokens (`_profile_tokens`)."""
        if shape.batch_size == 1 and self.slice_lengths:
            family.tokens = family.tokens or sequence_positions(shape)
            if family.length(shape) is not None:
                return self._profile_tokens(family, batch, shape)
        if self.grow_corners and self.slice_lengths and self._profile_corner(family, batch, shape):
            return ()
        family.profiles[sample_key(shape)] = (shape, self.profile_fn(batch, True), True)
        self.profile_runs += 1
        x = family.length(shape)
        done = (x,) if x is not None else ()
        if x is None and self.slice_lengths and family.point(shape) is not None:
            self._profile_crops(family, batch, shape)
            return done
        if self.slice_lengths and family.prefixes_misfit(shape.batch_size):
            self.slice_lengths = False
            self.slice_error = (
                "the bytes of prefixes of a batch differ from those of real batches of the same shape (the model's "
                "memory depends on the contents, e.g. an attention mask dropped when a batch has no padding)"
            )
        if x is None or not self.slice_lengths:
            return done
        positions = family.positions()
        fitted = family.shape_profile()
        err = None if fitted is None else fitted.fit_error(shape.batch_size)
        if err is not None and err <= FIT_TOLERANCE:  # the new length refines a checked fit: no prefixes needed
            return done
        known = fitted.lengths if fitted is not None else ()
        known = (*known, *(family.length(s) for s, _, _ in family.profiles.values()))
        for short in shorter_lengths(x, known):
            part = slice_length(batch, positions, short)
            part_shape = shape_of(part)
            try:
                profile = self.profile_fn(part, False)
            except InfeasibleBudgetError:  # a prefix whose passes do not fit beside the batch: no shorter ones
                break
            except Exception as err:  # noqa: BLE001 - a prefix the model rejects: fit from full batches only
                self.slice_error = f"{type(err).__name__}: {err}"
                self.slice_lengths = False
                break
            family.profiles[sample_key(part_shape)] = (part_shape, profile, False)
            self.profile_runs += 1
            done += (short,)
        return done

    def _profile_crops(self, family: ShapeFamily, batch: Any, shape: BatchShape) -> None:
        """Profile crops of a batch whose sizes vary apart on several axes (`profiling.structure.shapes.crop_points`),
        one at a time until the fit over every profiled size passes its check; none once it does (a new
        batch then only refines it) or once the fit has `MAX_GRID_POINTS` points."""
        axes, point = family.axes(), family.point(shape)
        for p in crop_points(point, family.aligned()):
            grid = family.grid()
            if grid is not None and (grid.model(shape.batch_size) is not None or len(grid.points) >= MAX_GRID_POINTS):
                return
            if grid is not None and p in dict(grid.points):
                continue
            part = crop(batch, axes, p)
            part_shape = shape_of(part)
            try:
                profile = self.profile_fn(part, False)
            except InfeasibleBudgetError:  # a crop whose passes do not fit beside the batch: left out
                continue
            except Exception as err:  # noqa: BLE001 - a crop the model rejects: each shape profiled from then on
                self.slice_error = f"{type(err).__name__}: {err}"
                self.slice_lengths = False
                return
            family.profiles[sample_key(part_shape)] = (part_shape, profile, False)
            self.profile_runs += 1

    def _profile_corner(self, family: ShapeFamily, batch: Any, shape: BatchShape) -> bool:
        """Profile `batch` grown to `grown_point` when its sizes lie a little past those of a fit over several
        sizes that passes its check, and the pass there is predicted (from the passes of every profiled point,
        `MARGIN` held back) to fit the room; -> whether the fit then costs `shape`. A grown batch the model
        rejects ends growing and cropping alike; a fit that fails its check with the new point has the batch
        profiled as it is after all."""
        grid, point = family.grid(), family.point(shape)
        chosen = None if grid is None or point is None else grid.model(shape.batch_size)
        if chosen is None or self.room_fn is None:
            return False
        corner = grown_point(point, grid.scale, family.aligned())
        largest = [max((c for c in (*p.probes, p.check) if c is not None), key=lambda c: c.batch_size) for _, p in grid.points]
        if corner == tuple(point) or len({c.batch_size for c in largest}) != 1 or any("pass_bytes" not in c.meta for c in largest):
            return False
        predicted = grid.predicted([c.meta["pass_bytes"] for c in largest], corner, chosen[0])
        room = self.room_fn(batch)
        if room is None or predicted * (1 + MARGIN) > room:
            return False
        part = crop(batch, family.axes(), corner)
        part_shape = shape_of(part)
        try:
            profile = self.profile_fn(part, False)
        except InfeasibleBudgetError:  # its passes do not fit beside the batch: not grown
            return False
        except Exception as err:  # noqa: BLE001 - a size the model rejects: each shape profiled from then on
            self.slice_error, self.slice_lengths = f"{type(err).__name__}: {err}", False
            return False
        family.profiles[sample_key(part_shape)] = (part_shape, profile, False)
        self.profile_runs += 1
        return family.cost_of(shape) is not None

    def _profile_tokens(self, family: ShapeFamily, batch: Any, shape: BatchShape) -> tuple[int, ...]:
        """A batch of one sample profiled on prefixes of its sequence, shortest first, and whole when it is
        predicted to fit (`engine.length_profiles.profile_lengths`)."""
        x, profile_at = family.length(shape), self._prefix_profiler(family, batch, shape)
        known = {family.length(s) for s, _, _ in family.profiles.values()}
        room = None if self.room_fn is None else functools.partial(self.room_fn, batch)
        done = profile_lengths(x, known, profile_at, room)
        if x not in done and not self.slice_lengths:  # no prefix could be cut: the batch itself, as before
            profile_at(x)
            done += (x,)
        return done

    def _too_long(
        self, family: ShapeFamily, shape: BatchShape, lengths: tuple[int, ...],
        longest: tuple[int, int, tuple[int, ...]] | None, planned: bool = False,
    ) -> InfeasibleBudgetError:
        """The refusal of a batch of one sample its prefixes could not cost (`planned`: costed after the search for
        the longest prefix, no plan fits), with what the pass on the whole measured, the `longest` prefix that
        fits (`longest_by_prefixes`), and the bytes of the prefixes profiled under checkpointing to extrapolate from."""
        passes = {
            family.length(s): int(p.probes[0].meta["pass_bytes"]) for s, p, _ in family.profiles.values()
            if p.probes[0].meta.get("under_checkpointing") and family.length(s) is not None and s.batch_size == 1
        }
        return too_long(shape, family.length(shape), lengths, self.slice_error, self.whole_shortfall, longest, passes, planned)

    def _prefix_profiler(self, family: ShapeFamily, batch: Any, shape: BatchShape) -> Callable[[int], Profile]:
        """Profile the batch of one sample at a prefix of its sequence (whole at its own length) and keep the
        profile in `family`; a prefix that does not fit is `SampleTooLong` (the whole's shortfall kept)."""
        positions, x = family.positions(), family.length(shape)

        def profile_at(length: int) -> Profile:
            own = length == x
            part = batch if own else slice_length(batch, positions, length)
            try:
                profile = self.profile_fn(part, own)
            except SampleTooLong as err:
                if own:
                    self.whole_shortfall = err.shortfall or self.whole_shortfall
                raise
            except InfeasibleBudgetError as err:  # (what stays resident leaves a prefix no room)
                if own:
                    raise
                raise SampleTooLong(str(err)) from None
            except Exception as err:  # noqa: BLE001 - a prefix the model rejects: the batch is profiled whole
                if own:
                    raise
                self.slice_error, self.slice_lengths = f"{type(err).__name__}: {err}", False
                raise SampleTooLong(self.slice_error) from None
            part_shape = shape_of(part)
            family.profiles[sample_key(part_shape)] = (part_shape, profile, own)
            self.profile_runs += 1
            return profile

        return profile_at


@dataclass(frozen=True)
class CostSource:
    """`cost_of` with the step fields every plan of the run shares (the gradients a step holds:
    `engine.step_grads`), as the `at(batch_size, **step_fields)` the planners' callers take."""

    cost_of: CostOf
    grads_live_in_forward: bool = True
    grads_accumulate: bool = False

    @property
    def grad_fields(self) -> tuple[bool, bool]:
        return self.grads_live_in_forward, self.grads_accumulate

    def at(self, batch_size: int, **step_fields) -> StepCost:
        step_fields.update(grads_live_in_forward=self.grads_live_in_forward, grads_accumulate=self.grads_accumulate)
        return self.cost_of(batch_size, **step_fields)


def same_regions(a: Plan | None, b: Plan | None) -> bool:
    """Whether two plans apply the same checkpoint regions (segments, inner segments, kept op calls)."""
    if a is None or b is None:
        return False
    return (a.segments, a.inner_segments, a.keeps) == (b.segments, b.inner_segments, b.keeps)


def describe(decision: ShapeDecision, plans: ShapePlans) -> str:
    """One line for a batch shape met for the first time: its plan, where its cost came from, what it took."""
    plan = decision.plan
    ckpt = f"{len(plan.checkpointed)}/{plan.n_blocks} blocks in {len(plan.segments)} segment(s)" if plan.segments else "nothing"
    budget = "" if plan.budget_bytes is None else f" of {format_bytes(plan.budget_bytes)}"
    took = f"planned in {1e3 * decision.plan_s:.0f} ms"
    if decision.profiled_lengths:
        took = f"profiled at length(s) {', '.join(map(str, decision.profiled_lengths))} in {decision.profile_s:.2f} s, " + took
    elif decision.profile_s:
        took = f"profiled in {decision.profile_s:.2f} s, " + took
    return (
        f"lightning-ckpt: new batch shape ({decision.shape.describe()}): checkpointing {ckpt}, predicted "
        f"{format_bytes(plan.predicted_peak_bytes)}{budget}; cost {decision.source}; {took} "
        f"({len(plans.plans)} shape(s) planned, {plans.profile_runs} profiled so far)"
    )


def largest_shape(shapes: list[BatchShape]) -> BatchShape:
    """The elementwise largest of shapes of one layout (batch size and every size)."""
    first = shapes[0]
    if any(not first.same_layout(s) for s in shapes):
        raise ValueError(
            "the ranks' batches have different layouts (other tensors or numbers of dimensions): "
            f"{'; '.join(s.describe() for s in shapes)}. Every rank must get batches of one structure."
        )
    sizes = tuple(tuple(max(s.shapes[i][d] for s in shapes) for d in range(len(dims))) for i, dims in enumerate(first.shapes))
    return BatchShape(max(s.batch_size for s in shapes), sizes)
