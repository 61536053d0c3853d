"""Step costs across shapes that vary in several independent sizes: the height and width of images, the
source and target lengths of a seq2seq batch.

Each profiled shape is a point, one size per axis. Every quantity of the step (each block's bytes and
work, the bytes around the chain) is a least-squares combination of a few features of the point, field by
field; the features are the simplest of `MODELS` whose leave-one-out check (each point predicted from the
others) misses by at most `FIT_TOLERANCE` of the checked bytes: linear in the product of the sizes (a
convolutional stage holds bytes in proportion to its pixels), with its square (attention over flattened
patches), bilinear, then a full quadratic. A point is costed inside the profiled sizes (sizes below the
smallest profiled are raised to it: memory grows with every size, so that over-counts) and up to
`EXTRAPOLATE` times past the largest on each axis, with the checked miss (a share of the checked bytes, and the
blocks' transients' in bytes: `shape_profile.held_bytes`), grown with the square of that stretch, held in reserve. A point farther out is profiled: `grown_point` says where, so that the one profile
reaches it and as far again on every other axis. Plain data, no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.cost_combination import CostCombination, with_pre_saved
from lightning_ckpt.planning.shape_profile import FIT_TOLERANCE, checked_bytes, stacked, worst_misses

MODELS = ("area", "area and its square", "bilinear", "quadratic")
CHECK_POINTS = 1  # a point beyond a model's features: each point is predicted from the others, as for one length
# (`shape_profile.MIN_FIT_LENGTHS`); a point that misses fails the model, and further points keep refining it
EXTRAPOLATE = 1.25  # a point may be this many times the largest profiled size on each axis

MAX_COSTS = 512  # points' costs kept for when they are costed again
_SERIALS = itertools.count()
GROW = 1.5  # a point at most this far past the profiled sizes is profiled at `grown_point`; farther, at itself

Point = tuple[int, ...]


def grown_point(point: Sequence[int], scale: Sequence[int], aligned: Sequence[int]) -> Point:
    """Where to profile for `point`, past the largest profiled sizes (`scale`) by a stretch of at most `GROW`:
    every axis grown by that stretch (at least to `point`'s size, rounded up to the axis's alignment), so that
    later points out as far on the other axes are reached too, not each profiled in turn; `point` itself when
    it is farther out (the stretch is a guess at the sizes to come; beyond `GROW` it is not made)."""
    stretch = max(n / s for n, s in zip(point, scale))
    if stretch > GROW:
        return tuple(point)
    return tuple(max(n, -(-math.ceil(s * stretch) // a) * a) for n, s, a in zip(point, scale, aligned))


def features(model: str, u: Sequence[float]) -> list[float]:
    """The features of a point (sizes scaled to at most 1) under `model`."""
    area = math.prod(u)
    if model == "area":
        return [1.0, area]
    if model == "area and its square":
        return [1.0, area, area * area]
    if model == "bilinear":
        return [1.0, *u, area]
    if model == "quadratic":
        return [1.0, *u, *(u[i] * u[j] for i in range(len(u)) for j in range(i, len(u)))]
    raise ValueError(f"a shape model is one of {MODELS}, got {model!r}.")


@dataclass(frozen=True)
class Reach:
    """How a point is costed from the fit: at `point` (the asked one with sizes below the profiled ones raised),
    `stretch` (>= 1) past the largest profiled size, `reserve_share` of the checked bytes held in reserve."""

    point: Point
    stretch: float
    model: str
    error: float
    reserve_share: float
    transient_bytes: int = 0  # the checked miss of the transients (`GridProfile.transient_miss_bytes`), held too

    @property
    def extrapolated(self) -> bool:
        return self.stretch > 1.0


@dataclass(frozen=True)
class GridProfile:
    """Profiles at distinct points of one number of axes, all with the same blocks."""

    points: tuple[tuple[Point, Profile], ...]
    _models: dict = field(default_factory=dict, compare=False, repr=False)  # batch size -> (model, error) or None
    _transients: dict = field(default_factory=dict, compare=False, repr=False)  # batch size -> the chosen model's miss
    _costs: dict = field(default_factory=dict, compare=False, repr=False)  # each line and model's weights
    _point_costs: dict = field(default_factory=dict, compare=False, repr=False)  # at most `MAX_COSTS`
    # what the points alone decide, read for every point costed: set once in `__post_init__`
    _scale: Point = field(init=False, compare=False, repr=False)
    _lowest: Point = field(init=False, compare=False, repr=False)
    _at_point: dict = field(init=False, compare=False, repr=False)  # point -> its profile
    serial: int = field(init=False, compare=False, repr=False)  # this fit's own number in the process (`cost_key`)

    def __post_init__(self) -> None:
        pts = [p for p, _ in self.points]
        if not pts or len(set(pts)) != len(pts) or len({len(p) for p in pts}) != 1 or any(n < 1 for p in pts for n in p):
            raise ValueError(f"a GridProfile needs distinct points of positive sizes, all of one dimension; got {pts}.")
        blocks = {p.n_blocks for _, p in self.points}
        if len(blocks) != 1:
            raise ValueError(f"profiles at different points disagree on the number of blocks: {sorted(blocks)}.")
        axes = range(len(pts[0]))
        object.__setattr__(self, "_scale", tuple(max(p[i] for p in pts) for i in axes))
        object.__setattr__(self, "_lowest", tuple(min(p[i] for p in pts) for i in axes))
        object.__setattr__(self, "_at_point", dict(self.points))
        object.__setattr__(self, "serial", next(_SERIALS))

    @property
    def scale(self) -> tuple[int, ...]:
        return self._scale

    @property
    def lowest(self) -> tuple[int, ...]:
        return self._lowest

    def _matrix(self, model: str, pts: Sequence[Point]) -> np.ndarray:
        scale = self._scale
        return np.array([features(model, [n / s for n, s in zip(p, scale)]) for p in pts], dtype=float)

    def model(self, batch_size: int) -> tuple[str, float] | None:
        """The simplest model whose leave-one-out check at `batch_size` is within `FIT_TOLERANCE`, and its
        worst miss (a share of the checked bytes at the point left out); None when none passes."""
        if batch_size not in self._models:
            self._models[batch_size] = self._choose(batch_size)
        return self._models[batch_size]

    def errors(self, batch_size: int) -> dict[str, float]:
        """The leave-one-out miss of every model that has enough points to be checked."""
        values = stacked([p.at(batch_size) for _, p in self.points])
        return {m: e[0] for m in MODELS if (e := self._leave_one_out(m, *values)) is not None}

    def transient_miss_bytes(self, batch_size: int) -> int | None:
        """The chosen model's worst leave-one-out miss, in bytes, of any size the memory model holds, transients
        included (`shape_profile.held_bytes`): its costs hold it in reserve beside the checked share."""
        return None if self.model(batch_size) is None else int(math.ceil(self._transients[batch_size]))

    def _choose(self, batch_size: int) -> tuple[str, float] | None:
        values = stacked([p.at(batch_size) for _, p in self.points])
        for m in MODELS:
            found = self._leave_one_out(m, *values)
            if found is not None and found[0] <= FIT_TOLERANCE:
                self._transients[batch_size] = found[1]
                return m, found[0]
        return None

    def _leave_one_out(self, model: str, values: np.ndarray, checked: int) -> tuple[float, float] | None:
        """Worst miss of each point predicted by the model fitted to the others, of the first `checked`
        quantities as a share and of all in bytes (None: too few points, or points that cannot tell the model's
        features apart)."""
        f = self._matrix(model, [p for p, _ in self.points])
        n, m = f.shape
        if n < m + CHECK_POINTS:
            return None
        worst, reserve = 0.0, 0.0
        for k in range(n):
            rest = np.arange(n) != k
            if np.linalg.matrix_rank(f[rest]) < m:
                return None
            coef, *_ = np.linalg.lstsq(f[rest], values[rest], rcond=None)
            miss, every = worst_misses(f[k] @ coef, values[k], checked)
            worst, reserve = max(worst, miss), max(reserve, every)
        return worst, reserve

    def predicted(self, values: Sequence[float], point: Sequence[int], model: str) -> float:
        """One quantity measured at every profiled point (in the order of `points`), predicted at `point` by
        the least-squares fit of `model` (a guess past the profiled sizes: an estimate, not a checked cost)."""
        f = self._matrix(model, [p for p, _ in self.points])
        coef, *_ = np.linalg.lstsq(f, np.asarray(values, dtype=float), rcond=None)
        return float(self._matrix(model, [tuple(point)])[0] @ coef)

    def reach(self, point: Sequence[int], batch_size: int) -> Reach | None:
        """How the fit costs `point` at `batch_size`, or None: no model passes its check, or a size is more
        than `EXTRAPOLATE` times the largest profiled one on its axis."""
        chosen = self.model(batch_size)
        scale = self._scale
        if chosen is None or len(point) != len(scale):
            return None
        raised = tuple(max(n, lo) for n, lo in zip(point, self._lowest))
        stretch = max(1.0, *(n / s for n, s in zip(raised, scale)))
        if stretch > EXTRAPOLATE:
            return None
        model, err = chosen
        # [reserve] inside: the checked miss; past the profiled sizes: at least the tolerance, grown with the stretch squared
        share = err if stretch == 1.0 else max(err, FIT_TOLERANCE) * stretch**2
        transient = int(math.ceil(self._transients[batch_size] * stretch**2))
        return Reach(raised, stretch, model, err, share, transient)

    def cost_key(self, reach: Reach) -> tuple:
        """What `cost(reach, ...)` reads besides the batch size: this fit (`serial`, never reused, so a key
        holds no fit alive), the profile at a profiled point, else the model's features at the point; and the
        reserve. Points of equal keys cost the same step."""
        if reach.point in self._at_point:
            where: tuple = ("profiled", reach.point)
        else:
            where = (reach.model, tuple(features(reach.model, [n / s for n, s in zip(reach.point, self._scale)])))
        return (self.serial, *where, reach.reserve_share, reach.transient_bytes)

    def at(self, batch_size: int, point: Sequence[int], model: str, **step_fields) -> StepCost:
        """The step cost at `point`: its own profile where it was profiled, else the fit of `model`."""
        point = tuple(point)
        exact = self._at_point.get(point)
        if exact is not None:
            return exact.at(batch_size, **step_fields)
        costs, points = self._costs, self._point_costs
        key = (batch_size, point, model, tuple(sorted(step_fields.items())))
        found = points.get(key)
        if found is None:
            line = (batch_size, key[3])
            if line not in costs:  # each profile's line at this batch, gathered once for every point
                costs[line] = CostCombination([p.at(batch_size, **step_fields) for _, p in self.points])
            if model not in costs:  # the fit's weights are features @ pinv: pinv once per model
                costs[model] = np.linalg.pinv(self._matrix(model, [p for p, _ in self.points]))
            w = np.array(features(model, [n / s for n, s in zip(point, self._scale)])) @ costs[model]
            found = costs[line].combine(w.tolist())
            if len(points) >= MAX_COSTS:  # the oldest first: a run of many shapes holds no cost without bound
                del points[next(iter(points))]
            points[key] = found
        return found

    def cost(self, reach: Reach, batch_size: int, **step_fields) -> StepCost:
        """The cost at `reach.point` with its reserve held as resident bytes before the chain."""
        cost = self.at(batch_size, reach.point, reach.model, **step_fields)
        reserve = int(math.ceil(reach.reserve_share * sum(checked_bytes(cost)))) + reach.transient_bytes
        return with_pre_saved(cost, reserve)
