"""Costs across lengths: exact where profiled, a checked quadratic in between, never trusted outside."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.shape_profile import FIT_TOLERANCE, ShapeProfile, checked_bytes, fit_costs


def _step(batch: int, length: int, quad: float = 1.0, n_blocks: int = 3, extra=lambda s: 0.0) -> StepCost:
    """A step whose per-sample bytes are `64 s + quad * s**2` (attention scores) plus `extra(s)`."""
    def per_sample(i: int) -> float:
        return (i + 1) * (64 * length + quad * length**2 + extra(length))

    blocks = tuple(
        BlockCost(
            name=f"b{i}",
            saved_bytes=int(batch * per_sample(i)),
            input_bytes=batch * 32 * length,
            output_bytes=batch * 32 * length,
            fwd_transient_bytes=batch * 8 * length,
            fwd_flops=int(batch * 1000 * length + batch * 10 * length**2),
            grad_bytes=4096,
        )
        for i in range(n_blocks)
    )
    return StepCost(blocks=blocks, batch_size=batch, batch_bytes=batch * 8 * length, pre_saved_bytes=batch * 4 * length)


def _profile(length: int, **kw) -> Profile:
    return Profile(probes=(_step(1, length, **kw), _step(2, length, **kw)))


def _shapes(lengths, **kw) -> ShapeProfile:
    return ShapeProfile(tuple((x, _profile(x, **kw)) for x in lengths))


def test_a_profiled_length_is_its_own_profile():
    sp = _shapes([32, 48, 64])
    assert sp.at(16, 48) == _profile(48).at(16)


@pytest.mark.parametrize("length", [40, 56, 100, 127])
def test_quadratic_bytes_are_fitted_exactly_between_profiled_lengths(length):
    sp = _shapes([32, 64, 96, 128])
    got, want = sp.at(16, length), _step(16, length)
    for g, w in zip(got.blocks, want.blocks):
        assert g.saved_bytes == pytest.approx(w.saved_bytes, abs=2)
        assert g.fwd_flops == pytest.approx(w.fwd_flops, abs=2)
        assert g.input_bytes == pytest.approx(w.input_bytes, abs=2)
    assert got.batch_bytes == pytest.approx(want.batch_bytes, abs=2)


def test_fit_error_is_none_until_a_quadratic_can_be_checked():
    assert _shapes([32, 64, 128]).fit_error(16) is None
    assert not _shapes([32, 64, 128]).covers(48, 16)
    assert _shapes([32, 64, 96, 128]).fit_error(16) == pytest.approx(0.0, abs=1e-6)


def test_a_length_outside_the_profiled_range_is_never_covered():
    sp = _shapes([32, 64, 96, 128])
    assert sp.covers(80, 16)
    assert not sp.covers(129, 16)
    assert not sp.covers(31, 16)
    assert sp.covers(128, 16) and sp.covers(32, 16)


def test_bytes_that_are_not_a_quadratic_fail_the_check():
    """A cubic term (say, a cache growing with s**3) is caught by leaving lengths out."""
    sp = _shapes([16, 32, 64, 128], extra=lambda s: s**3 / 4)
    err = sp.fit_error(16)
    assert err is not None and err > FIT_TOLERANCE
    assert not sp.covers(48, 16)


def test_one_profiled_length_cannot_be_extrapolated():
    with pytest.raises(ValueError, match="cannot be extrapolated"):
        _shapes([32]).at(4, 64)


def test_lengths_must_ascend_and_be_distinct():
    with pytest.raises(ValueError, match="ascending"):
        ShapeProfile(((64, _profile(64)), (32, _profile(32))))
    with pytest.raises(ValueError, match="at least one"):
        ShapeProfile(())


def test_with_profile_adds_in_order_and_round_trips():
    sp = _shapes([32, 128]).with_profile(64, _profile(64))
    assert sp.lengths == (32, 64, 128)
    back = ShapeProfile.from_dict(sp.to_dict())
    assert back.lengths == sp.lengths and back.at(8, 64) == sp.at(8, 64)


def test_ops_differing_between_lengths_give_no_op_options():
    from lightning_ckpt.costs.block_costs import OpCost

    a, b = _step(4, 32), _step(4, 64)
    op = OpCost("aten.mm.default", 0, keep_bytes=100, saved=True, keepable=True)
    other = OpCost("aten.bmm.default", 0, keep_bytes=100, saved=True, keepable=True)
    import dataclasses

    a = dataclasses.replace(a, blocks=tuple(dataclasses.replace(x, ops=(op,)) for x in a.blocks))
    same = dataclasses.replace(b, blocks=tuple(dataclasses.replace(x, ops=(dataclasses.replace(op, keep_bytes=200),)) for x in b.blocks))
    diff = dataclasses.replace(b, blocks=tuple(dataclasses.replace(x, ops=(other,)) for x in b.blocks))
    assert fit_costs([a, same], [32, 64], 48).blocks[0].ops[0].keep_bytes == 150
    assert fit_costs([a, diff], [32, 64], 48).blocks[0].ops == ()


@settings(max_examples=40, deadline=None)
@given(
    quad=st.integers(0, 4),  # integer bytes per element, as real storages have
    lengths=st.lists(st.integers(8, 256), min_size=4, max_size=6, unique=True),
    batch=st.integers(1, 64),
    data=st.data(),
)
def test_property_the_fit_reproduces_any_quadratic_inside_the_range(quad, lengths, batch, data):
    lengths = sorted(lengths)
    sp = _shapes(lengths, quad=quad)
    x = data.draw(st.integers(lengths[0], lengths[-1]))
    assert sp.covers(x, batch)
    # against the line a profile at x itself would give (the synthetic bytes are rounded per probe)
    got, want = sp.at(batch, x), _profile(x, quad=quad).at(batch)
    for g, w in zip(got.blocks, want.blocks):
        assert abs(g.saved_bytes - w.saved_bytes) <= 2 * batch + 1e-6 * w.saved_bytes


def test_a_transient_that_is_no_polynomial_is_held_in_reserve_not_checked():
    import dataclasses

    from lightning_ckpt.engine.length_profiles import extrapolated

    def floored(length: int) -> Profile:  # a backward scratch: the larger of a fixed buffer and one in the length
        def step(batch: int) -> StepCost:
            s = _step(batch, length)
            blocks = tuple(dataclasses.replace(b, bwd_transient_bytes=max(40_000, batch * 600 * length)) for b in s.blocks)
            return dataclasses.replace(s, blocks=blocks)

        return Profile(probes=(step(1), step(2)))

    sp = ShapeProfile(tuple((x, floored(x)) for x in (16, 32, 48, 64, 96)))
    plain = _shapes([16, 32, 48, 64, 96])
    assert sp.fit_error(4) == plain.fit_error(4) and sp.transient_miss_bytes(4) > 1000 > plain.transient_miss_bytes(4)
    cost_of, source = extrapolated(sp, 110, 4, 1.25)
    growth = (110 / 96) ** 2
    share = max(sp.fit_error(4), FIT_TOLERANCE) * growth
    reserve = cost_of(4).pre_saved_bytes - sp.at(4, 110).pre_saved_bytes
    assert reserve == math.ceil(share * sum(checked_bytes(sp.at(4, 110)))) + math.ceil(sp.transient_miss_bytes(4) * growth)
    assert "for the transients held in reserve" in source
