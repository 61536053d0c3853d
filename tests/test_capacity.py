"""Largest batch that fits, from the model alone."""

from __future__ import annotations

import pytest

from lightning_ckpt.planning.capacity import largest_batch, plan_if_fits
from lightning_ckpt.costs.block_costs import BlockCost, StepCost


def cost_at(b: int) -> StepCost:
    """Four blocks whose bytes grow linearly with the batch; 1000 bytes of static memory."""
    blocks = tuple(
        BlockCost(f"b{i}", saved_bytes=100 * b, input_bytes=5 * b, input_saved_bytes=5 * b, output_bytes=5 * b, fwd_flops=10 * b)
        for i in range(4)
    )
    return StepCost(blocks=blocks, batch_size=b, static_bytes=1000)


@pytest.mark.parametrize("multiple", [1, 4, 8])
@pytest.mark.parametrize("budget", [1500, 4000, 20000])
def test_largest_batch_is_the_boundary(multiple, budget):
    best, plan = largest_batch(cost_at, budget, "optimal", multiple)
    assert best % multiple == 0
    if best:
        assert plan is not None and plan.fits and plan.batch_size == best
    assert plan_if_fits(cost_at(best + multiple), budget) is None
    # brute force over every multiple below a generous cap
    fitting = [b for b in range(multiple, 400, multiple) if plan_if_fits(cost_at(b), budget) is not None]
    assert best == (max(fitting) if fitting else 0)


def test_nothing_fits_and_no_growth():
    assert largest_batch(cost_at, 900) == (0, None)
    flat = lambda b: StepCost(blocks=(BlockCost("b", saved_bytes=10, input_bytes=1),), batch_size=b)  # noqa: E731
    with pytest.raises(ValueError, match="no memory growth with the batch size"):
        largest_batch(flat, 10**6, limit=64)
    with pytest.raises(ValueError, match="batch_multiple=0 must be a positive integer"):
        largest_batch(cost_at, 10**6, multiple=0)



def test_nesting_never_lowers_the_largest_batch_and_raises_it_at_full_peaks():
    """At `full`'s peak for batch b, single-level plans reach b; one byte under, they stop below b while
    a plan with inner segments still fits b. From batch 24 on, nesting fits b + 1 at `full`'s peak itself."""
    from lightning_ckpt.planning.policies import make_plan

    for b in (8, 24, 64):
        full = make_plan(cost_at(b), "full").predicted_peak_bytes
        single, nested = (largest_batch(cost_at, full, max_levels=k)[0] for k in (1, 2))
        assert single == b <= nested
        assert (nested > b) == (b >= 24)
        single, _ = largest_batch(cost_at, full - 1, max_levels=1)
        nested, plan = largest_batch(cost_at, full - 1, max_levels=2)
        assert single < b <= nested and plan.inner_segments and plan.fits and plan.batch_size == nested
        assert plan_if_fits(cost_at(b), full - 1, max_levels=1) is None
        assert plan_if_fits(cost_at(nested + 1), full - 1, max_levels=2) is None
    for budget in (1500, 1999, 4000, 20000):
        assert largest_batch(cost_at, budget, max_levels=2)[0] >= largest_batch(cost_at, budget, max_levels=1)[0]
