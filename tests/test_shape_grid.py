"""Costs over several independent sizes: a checked fit over the profiled points, chosen as the simplest model
that passes, costed inside the profiled sizes and a little past them with the checked miss in reserve."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.shape_grid import EXTRAPOLATE, GridProfile, features
from lightning_ckpt.planning.shape_profile import FIT_TOLERANCE, checked_bytes
from lightning_ckpt.profiling.structure.shapes import alignment, axes_of, crop, crop_points, point_of, shape_of


def _step(batch: int, point, per_sample) -> StepCost:
    blocks = tuple(
        BlockCost(
            name=f"b{i}", saved_bytes=int(batch * (i + 1) * per_sample(point)), input_bytes=int(batch * 4 * math.prod(point)),
            output_bytes=int(batch * 4 * math.prod(point)), fwd_flops=int(batch * 100 * math.prod(point)), grad_bytes=4096,
        )
        for i in range(3)
    )
    return StepCost(blocks=blocks, batch_size=batch, batch_bytes=int(batch * 12 * math.prod(point)), pre_saved_bytes=64)


def _grid(points, per_sample=lambda p: 48 * p[0] * p[1]) -> GridProfile:
    return GridProfile(tuple((p, Profile(probes=(_step(1, p, per_sample), _step(2, p, per_sample)))) for p in points))


CROPS = [(64, 48), (32, 48), (64, 24), (32, 24), (40, 80)]


def test_bytes_in_proportion_to_the_pixels_are_fitted_by_the_area_and_costed_exactly_inside():
    grid = _grid(CROPS)
    model, err = grid.model(8)
    assert model == "area" and err == 0.0
    reach = grid.reach((56, 40), 8)
    assert reach is not None and not reach.extrapolated and reach.reserve_share == 0.0
    assert checked_bytes(grid.cost(reach, 8)) == checked_bytes(_step(8, (56, 40), lambda p: 48 * p[0] * p[1]))


def test_a_point_past_the_profiled_sizes_is_extrapolated_with_a_reserve_and_refused_too_far():
    grid = _grid(CROPS)
    past = grid.reach((72, 96), 8)  # 1.2x the largest width profiled
    assert past is not None and past.extrapolated
    assert past.reserve_share == pytest.approx(FIT_TOLERANCE * (96 / 80) ** 2)
    exact = sum(checked_bytes(_step(8, (72, 96), lambda p: 48 * p[0] * p[1])))
    assert sum(checked_bytes(grid.cost(past, 8))) >= exact * (1 + past.reserve_share) - 1
    assert grid.reach((64, int(80 * EXTRAPOLATE) + 1), 8) is None


def test_sizes_below_the_profiled_ones_are_raised_to_them_which_over_counts():
    grid = _grid(CROPS)
    low = grid.reach((8, 8), 8)
    assert low.point == (32, 24) and not low.extrapolated


def test_a_term_in_each_size_apart_needs_a_richer_model_and_too_few_points_check_none():
    def bilinear(p):
        return 48 * p[0] * p[1] + 4000 * p[0]

    grid = _grid([*CROPS, (48, 64)], bilinear)
    assert grid.model(8)[0] == "bilinear"  # 'area' misses the term in the height
    assert grid.errors(8)["area"] > FIT_TOLERANCE
    assert _grid(CROPS[:2]).model(8) is None  # two features need a point beyond them for the check
    assert _grid(CROPS[:3]).model(8) is None  # two of the same area cannot tell the area's term from the constant
    three = [(64, 48), (32, 48), (32, 24)]  # each predicted by the line through the other two
    assert _grid(three).model(8) == ("area", 0.0)
    assert _grid(three, bilinear).model(8) is None and _grid(three, bilinear).errors(8)["area"] > FIT_TOLERANCE
    assert _grid([(32, 24), (64, 48), (128, 96), (16, 12)]).model(8) is not None


def test_features_and_points_are_checked():
    assert features("bilinear", [0.5, 0.25]) == [1.0, 0.5, 0.25, 0.125]
    with pytest.raises(ValueError, match="a shape model is one of"):
        features("cubic", [1.0, 1.0])
    with pytest.raises(ValueError, match="distinct points of positive sizes"):
        _grid([(8, 8), (8, 8)])


def test_image_height_and_width_are_separate_axes_once_one_batch_is_not_square_and_crops_cut_both():
    from lightning_ckpt.profiling.structure.shapes import varying_positions

    batches = [(torch.zeros(4, 3, h, w), torch.zeros(4, h, w)) for h, w in ((32, 32), (48, 48))]
    shapes = [shape_of(b) for b in batches]
    positions = varying_positions(shapes)
    assert len(axes_of(shapes, positions)) == 1  # square images only: one length
    shapes.append(shape_of((torch.zeros(4, 3, 40, 56), torch.zeros(4, 40, 56))))
    axes = axes_of(shapes, varying_positions(shapes))
    assert axes == (((0, 2), (1, 1)), ((0, 3), (1, 2)))
    assert point_of(shapes[-1], axes) == (40, 56)
    assert alignment([32, 48, 40]) == 8 and alignment([37, 40]) == 1
    assert crop_points((40, 56), (8, 8)) == [(24, 32), (24, 56), (40, 32)]
    part = crop(batches[1], axes, (24, 32))
    assert [tuple(t.shape) for t in part] == [(4, 3, 24, 32), (4, 24, 32)]


def test_a_point_a_little_past_is_profiled_grown_on_every_axis_and_a_far_one_as_it_is():
    from lightning_ckpt.planning.shape_grid import GROW, grown_point

    assert grown_point((88, 40), (64, 64), (8, 8)) == (88, 88)  # 1.375x on the height: the width grown as far
    assert grown_point((84, 40), (64, 64), (4, 8)) == (84, 88)  # 64 * 1.3125 = 84, rounded up to 88 on the width
    assert grown_point((70, 100), (64, 80), (1, 1)) == (80, 100)  # 1.25x: 64 -> 80
    far = (int(64 * GROW) + 8, 40)
    assert grown_point(far, (64, 64), (8, 8)) == far  # too far past to guess the next sizes from


def test_a_quantity_measured_at_the_points_is_predicted_by_the_model_s_fit():
    grid = _grid(CROPS)
    values = [1000 + 3 * p[0] * p[1] for p, _ in grid.points]  # affine in the area, as the pass bytes of a CNN
    assert grid.predicted(values, (88, 96), "area") == pytest.approx(1000 + 3 * 88 * 96)
    curved = [1000 + 3 * p[0] * p[1] + 50 * p[0] for p, _ in grid.points]
    assert grid.predicted(curved, (88, 96), "bilinear") == pytest.approx(1000 + 3 * 88 * 96 + 50 * 88)


def test_crop_to_larger_sizes_repeats_the_batch_s_own_entries():
    x = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    mask = torch.ones(2, 5, dtype=torch.long)
    batch = (x, mask)
    axes = (((0, 1),), ((0, 2), (1, 1)))  # x's rows; x's columns with the mask's
    grown = crop(batch, axes, (7, 12))
    assert [tuple(t.shape) for t in grown] == [(2, 7, 12), (2, 12)]
    assert torch.equal(grown[0], x.repeat(1, 3, 3)[:, :7, :12]) and torch.equal(grown[1], torch.ones(2, 12, dtype=torch.long))
    assert grown[0].untyped_storage().nbytes() == grown[0].numel() * 4  # owns exactly its entries
    mixed = crop(batch, axes, (2, 9))  # cut on one axis, grown on the other
    assert torch.equal(mixed[0], x.repeat(1, 1, 2)[:, :2, :9])


def test_a_transient_off_the_model_is_held_in_reserve_without_failing_the_check():
    def with_floor(points):  # the backward holds the larger of a fixed gradient and one in the pixels
        def step(batch, p):
            s = _step(batch, p, lambda q: 48 * q[0] * q[1])
            blocks = tuple(dataclasses.replace(b, bwd_transient_bytes=max(10_000, batch * 4 * p[0] * p[1])) for b in s.blocks)
            return dataclasses.replace(s, blocks=blocks)

        return GridProfile(tuple((p, Profile(probes=(step(1, p), step(2, p)))) for p in points))

    grid = with_floor(CROPS)
    assert grid.model(8) == ("area", 0.0) and grid.transient_miss_bytes(8) > 0  # checked bytes exact, the transient not
    assert _grid(CROPS).transient_miss_bytes(8) == 0
    reach = grid.reach((56, 40), 8)
    fitted = grid.at(8, (56, 40), "area")
    assert reach.transient_bytes == grid.transient_miss_bytes(8)  # inside: the checked miss as it is
    assert grid.cost(reach, 8).pre_saved_bytes == fitted.pre_saved_bytes + reach.transient_bytes  # (no checked miss)
    past = grid.reach((72, 96), 8)  # 1.2x past: the transient's miss grown with the stretch squared
    assert past.transient_bytes == math.ceil(grid.transient_miss_bytes(8) * (96 / 80) ** 2)
