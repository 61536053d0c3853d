"""Plans per batch shape: cached, costed from profiles, the fit and bounds; profiling stays bounded."""

from __future__ import annotations

import dataclasses
import random

import torch
from test_shape_profile import _profile

from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.policies import make_plan
from lightning_ckpt.engine.shape_plans import BUCKET, ShapePlans, same_regions, sample_key
from lightning_ckpt.profiling.structure.shapes import shape_of, slice_length, varying_positions


def _batch(batch: int, length: int) -> dict:
    return {"input_ids": torch.zeros(batch, length, dtype=torch.long), "mask": torch.ones(batch, length), "y": torch.zeros(batch)}


class _Recorder:
    """A profiler whose bytes are a quadratic in the length whatever the contents, and a planner."""

    def __init__(self, budget: int | None = None) -> None:
        self.profiled: list[tuple[int, bool]] = []
        self.budget = budget

    def profile(self, batch, own):
        length = batch["input_ids"].shape[1]
        self.profiled.append((length, own))
        return _profile(length)

    def plan(self, cost_of, shape):
        return make_plan(cost_of(shape.batch_size), "none" if self.budget is None else "optimal", self.budget)


def test_a_repeated_shape_is_planned_once_and_a_new_length_profiled_with_its_prefixes():
    rec = _Recorder()
    plans = ShapePlans(rec.profile, rec.plan)
    first = plans.plan_for(_batch(8, 64))
    assert first.new and first.source == "profiled" and rec.profiled == [(64, True)]
    again = plans.plan_for(_batch(8, 64))
    assert not again.new and rec.profiled == [(64, True)]
    plans.plan_for(_batch(8, 128))  # now the varying dimension is known: prefixes at 64 and 96 too
    assert rec.profiled[1:] == [(128, True), (96, False)]  # 64 is known already
    unchecked = plans.plan_for(_batch(8, 80))  # three lengths cannot check a quadratic: profiled
    assert unchecked.source == "profiled" and rec.profiled[3] == (80, True)
    fitted = plans.plan_for(_batch(8, 72))
    assert fitted.source.startswith("fitted over lengths") and (72, True) not in rec.profiled


def test_with_contents_independent_bytes_random_lengths_are_fitted_after_few_profiles():
    rec = _Recorder()
    plans = ShapePlans(rec.profile, rec.plan)
    rng = random.Random(0)
    lengths = [rng.randint(16, 128) for _ in range(60)]
    sources = [plans.plan_for(_batch(8, x)).source for x in lengths]
    own = [x for x, o in rec.profiled if o]
    assert len(own) <= 8, f"{len(own)} real batches profiled for {len(set(lengths))} distinct lengths"
    assert sum(s.startswith("fitted") for s in sources) >= 40
    assert plans.plan_for(_batch(8, lengths[0])).new is False


def test_the_fit_never_stands_in_beyond_the_profiled_lengths():
    rec = _Recorder()
    plans = ShapePlans(rec.profile, rec.plan)
    for x in (64, 128, 100):
        plans.plan_for(_batch(8, x))
    n = len(rec.profiled)
    plans.plan_for(_batch(8, 200))
    assert rec.profiled[n] == (200, True)


def test_a_shape_slightly_smaller_than_a_profiled_one_is_bounded_by_it():
    rec = _Recorder()
    plans = ShapePlans(rec.profile, rec.plan, slice_lengths=False)
    plans.plan_for(_batch(8, 64))
    plans.plan_for(_batch(8, 128))
    inside = int(128 / (1 + BUCKET)) + 1
    d = plans.plan_for(_batch(8, inside))
    assert d.source.startswith("bounded by the profile at batch 8, tensors [8, 128]")
    assert len(rec.profiled) == 2
    d = plans.plan_for(_batch(8, 100))  # more than BUCKET below 128: profiled
    assert d.source == "profiled" and len(rec.profiled) == 3


def test_prefixes_that_disagree_with_real_batches_are_no_longer_profiled():
    """Contents matter (say an attention mask dropped without padding): prefixes hold fewer bytes."""

    class ContentsMatter(_Recorder):
        def profile(self, batch, own):
            super().profile(batch, own)
            length = batch["input_ids"].shape[1]
            return _profile(length, quad=1.0 if own else 0.0)

    rec = ContentsMatter()
    plans = ShapePlans(rec.profile, rec.plan)
    for x in (32, 128, 64, 96, 48, 80, 112):
        plans.plan_for(_batch(8, x))
    assert plans.slice_error is not None and "differ from those of real batches" in plans.slice_error
    prefixes_after = [o for x, o in rec.profiled[6:]]
    assert not any(o is False for o in prefixes_after)
    for d in plans.plans.values():  # every plan is costed from real batches, never from a prefix alone
        assert d.source == "profiled" or d.source.startswith(("fitted", "bounded"))


def test_the_batch_size_is_part_of_the_shape():
    rec = _Recorder()
    plans = ShapePlans(rec.profile, rec.plan)
    a = plans.plan_for(_batch(8, 64))
    b = plans.plan_for(_batch(3, 64))  # a last, smaller batch: the same profile, planned at its size
    assert b.new and b.plan.batch_size == 3 and a.plan.batch_size == 8
    assert len(rec.profiled) == 1
    assert sample_key(shape_of(_batch(3, 64))) == sample_key(shape_of(_batch(8, 64)))


def test_slices_along_the_varying_dimension_cut_every_tensor_that_has_it():
    a, b = shape_of(_batch(4, 10)), shape_of(_batch(4, 20))
    positions = varying_positions([a, b])
    assert positions == ((0, 1), (1, 1))
    part = slice_length(_batch(4, 20), positions, 7)
    assert part["input_ids"].shape == (4, 7) and part["mask"].shape == (4, 7) and part["y"].shape == (4,)


def test_same_regions_compares_what_is_applied():
    rec = _Recorder(budget=None)
    plans = ShapePlans(rec.profile, rec.plan)
    p = plans.plan_for(_batch(8, 64)).plan
    assert same_regions(p, p) and not same_regions(p, None) and not same_regions(None, None)
    other = dataclasses.replace(p, segments=((0, 1),))
    assert not same_regions(p, other)


def test_a_fitted_cost_holds_the_fit_s_checked_miss_in_reserve():
    """Bytes a little off a quadratic (a cubic term): the fit passes its check, and the cost it gives
    carries the checked miss as resident bytes, so it is never below the exact cost by more than that."""
    from test_shape_profile import _profile as exact

    def bumpy(length):
        return exact(length, extra=lambda s: s**3 / 2000)

    class Bumpy(_Recorder):
        def profile(self, batch, own):
            super().profile(batch, own)
            return bumpy(batch["input_ids"].shape[1])

    rec = Bumpy()
    plans = ShapePlans(rec.profile, rec.plan)
    for x in (64, 128, 80):
        plans.plan_for(_batch(8, x))
    family = next(iter(plans.families.values()))
    err = family.shape_profile().fit_error(8)
    assert 0 < err <= 0.01
    found = family.cost_of(shape_of(_batch(8, 100)))
    assert found is not None and found[1].startswith("fitted") and "held in reserve" in found[1]
    cost, truth = found[0](8), bumpy(100).at(8)
    fitted_only = family.shape_profile().at(8, 100)
    assert cost.pre_saved_bytes > fitted_only.pre_saved_bytes
    assert sum(b.saved_bytes for b in cost.blocks) + cost.pre_saved_bytes >= sum(b.saved_bytes for b in truth.blocks) + truth.pre_saved_bytes


class _OneSample(_Recorder):
    """`_Recorder` whose batches of one sample give a profile at batch size 1 only, and whose passes over
    `room` tokens are stopped (as a budget stops them)."""

    def __init__(self, room: int | None = None) -> None:
        super().__init__()
        self.room = room
        self.checkpointed_first: list[bool] = []  # per profile: asked to start under checkpointing

    def profile(self, batch, own):
        from lightning_ckpt.profiling.passes.profile_budget import SampleTooLong

        from lightning_ckpt.profiling.passes.profile_budget import wants_checkpointed_first

        length = batch["input_ids"].shape[1]
        if batch["input_ids"].shape[0] > 1:
            return super().profile(batch, own)
        self.profiled.append((length, own))
        self.checkpointed_first.append(wants_checkpointed_first())
        if self.room is not None and length > self.room:
            raise SampleTooLong("it reached the room the memory budget leaves profiling")
        one = dataclasses.replace(_profile(length).probes[0], meta={"pass_bytes": length * length})
        return type(_profile(length))(probes=(one, one))


def test_one_sample_too_long_to_profile_whole_is_costed_past_its_prefixes_and_kept_apart_from_lines():
    rec = _OneSample(room=100)
    plans = ShapePlans(rec.profile, rec.plan)
    first = plans.plan_for(_batch(1, 128))
    # shortest first; the whole stopped; then the prefixes between, up to the first that is stopped; then the
    # whole once more, asked to start under checkpointing (here stopped again)
    assert rec.profiled == [
        (32, False), (64, False), (96, False), (128, True), (48, False), (80, False), (112, False), (128, True)
    ]
    assert rec.checkpointed_first == [False] * 7 + [True]
    assert first.source.startswith("extrapolated from lengths 32, 48, 64, 80, 96 at batch 1")
    n = len(rec.profiled)
    assert plans.plan_for(_batch(1, 150)).source.startswith("extrapolated") and len(rec.profiled) == n
    assert plans.plan_for(_batch(1, 56)).source.startswith("fitted") and len(rec.profiled) == n
    lines = plans.plan_for(_batch(8, 64))  # a batch of several samples: profiled on lines, not the one-sample fit
    assert lines.source == "profiled" and rec.profiled[n] == (64, True)
    assert plans.plan_for(_batch(1, 64)).source == "profiled"  # the line of the batch of 8 costs one sample too
    plans.plan_for(_batch(8, 128))  # each family holds one kind: lines, or profiles at batch size 1 only
    kinds = {key: {p.one_size for _, p, _ in f.profiles.values()} for key, f in plans.families.items()}
    assert kinds == {(2, 2, 1): {False}, (2, 2, 1, -1): {True}}


class _Images:
    """A profiler of image batches whose bytes are in proportion to the pixels, passes' bytes included."""

    def __init__(self) -> None:
        self.profiled: list[tuple[int, int, bool]] = []

    def profile(self, batch, own):
        from test_shape_grid import _step

        h, w = batch[0].shape[2:]
        self.profiled.append((h, w, own))

        def probe(n):
            return dataclasses.replace(_step(n, (h, w), lambda p: 48 * p[0] * p[1]), meta={"pass_bytes": 1000 + 400 * n * h * w})

        return Profile(probes=(probe(2), probe(4)))

    def plan(self, cost_of, shape):
        return make_plan(cost_of(shape.batch_size), "none")


def _images(h: int, w: int):
    return torch.zeros(4, 3, h, w), torch.zeros(4, dtype=torch.long)


def _grown_run(room: int | None, grow: bool) -> tuple[_Images, list[str]]:
    rec = _Images()
    plans = ShapePlans(rec.profile, rec.plan, room_fn=lambda batch: room)
    plans.grow_corners = grow
    sources = [plans.plan_for(_images(h, w)).source for h, w in ((32, 48), (16, 40))]  # a checked fit over 3 points
    assert rec.profiled == [(32, 48, True), (16, 40, True), (8, 24, False)]
    sources += [plans.plan_for(_images(h, w)).source for h, w in ((44, 24), (24, 64))]  # 1.375x past on each axis
    return rec, sources


def test_a_batch_a_little_past_a_checked_fit_is_profiled_grown_once_for_every_axis():
    rec, sources = _grown_run(room=10**9, grow=True)
    assert rec.profiled[3:] == [(44, 72, False)]  # the height's stretch on the width too: 66, rounded up to 8
    assert sources[2].startswith("fitted within 4 profiled sizes at 44 x 24 ") and sources[3].startswith("fitted within")


def test_a_grown_pass_predicted_over_the_room_or_several_ranks_profile_the_batch_itself():
    room = int(1.1 * (1000 + 400 * 4 * 44 * 72)) - 1  # the grown pass's bytes and a little less than MARGIN
    for rec, sources in (_grown_run(room=room, grow=True), _grown_run(room=10**9, grow=False)):
        assert rec.profiled[3:] == [(44, 24, True), (24, 64, True)] and sources[2:] == ["profiled", "profiled"]
