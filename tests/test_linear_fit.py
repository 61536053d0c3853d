"""`Profile`: per-op costs are fitted on their own lines and survive a round trip."""

from __future__ import annotations

import pytest

from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost, backward_phase_peaks
from lightning_ckpt.costs.linear_fit import Profile


def _step(batch: int, ops: tuple[OpCost, ...]) -> StepCost:
    block = BlockCost("b0", saved_bytes=100 * batch, input_bytes=10 * batch, ops=ops)
    return StepCost(blocks=(block,), batch_size=batch)


def _ops(batch: int, second: str = "aten.gelu.default") -> tuple[OpCost, ...]:
    return (
        OpCost("aten.mm.default", 0, keep_bytes=64 * batch, saved=True, keepable=True, flops=1000 * batch),
        OpCost(second, 0, keep_bytes=64 * batch, saved=True, keepable=True, mem_bytes=64 * batch),
    )


def test_op_sizes_follow_their_own_lines():
    profile = Profile((_step(1, _ops(1)), _step(2, _ops(2))))
    ops = profile.at(8).blocks[0].ops
    assert [o.key for o in ops] == [("aten.mm.default", 0), ("aten.gelu.default", 0)]
    assert ops[0].keep_bytes == 512 and ops[0].flops == 8000 and ops[1].mem_bytes == 512


def test_ops_that_differ_between_probes_give_no_op_options():
    profile = Profile((_step(1, _ops(1)), _step(2, _ops(2, second="aten.relu.default"))))
    assert profile.at(8).blocks[0].ops == ()


def test_views_found_in_one_probe_only_are_left_out():
    """A batch of one may add or drop a `view`: the calls that can be kept still fit."""
    view = OpCost("aten.view.default", 0, keep_bytes=0, saved=False, keepable=False)
    profile = Profile((_step(1, (view, *_ops(1))), _step(2, _ops(2))))
    ops = profile.at(8).blocks[0].ops
    assert [o.key for o in ops] == [("aten.mm.default", 0), ("aten.gelu.default", 0)]
    assert ops[1].keep_bytes == 512


def test_calls_that_copy_from_batch_two_on_are_fitted_from_the_larger_probes():
    """At batch one a reshape is a view; from two on it copies (a keepable `clone`)."""
    clone = lambda b: OpCost("aten.clone.default", 0, keep_bytes=32 * b, saved=True, keepable=True, mem_bytes=32 * b)
    check = _step(4, (clone(4), *_ops(4)))
    profile = Profile((_step(1, _ops(1)), _step(2, (clone(2), *_ops(2)))), check=check)
    ops = profile.at(8).blocks[0].ops
    assert [o.key for o in ops] == [("aten.clone.default", 0), ("aten.mm.default", 0), ("aten.gelu.default", 0)]
    assert ops[0].keep_bytes == 256 and ops[1].flops == 8000
    assert Profile(profile.probes).at(8).blocks[0].ops == ()  # without the check: no options


def test_ops_round_trip_through_dicts():
    cost = _step(4, _ops(4))
    again = StepCost.from_dict(cost.to_dict())
    assert again.blocks[0].ops == cost.blocks[0].ops
    assert isinstance(again.blocks[0].ops[0], OpCost)


def test_keep_savings_follow_a_line_that_may_go_below_zero():
    """Measured savings of keeping (`lightning_ckpt.apply.keep_calibration`) are fitted like `fwd_ms`, but
    not clamped at 0: a negative saving says keeping loses time. One probe without them: None."""
    import dataclasses

    a, b = _step(1, _ops(1)), _step(2, _ops(2))

    def saving(step: StepCost, all_ms: float | None, draws_ms: float | None) -> StepCost:
        block = dataclasses.replace(step.blocks[0], keep_saved_ms=all_ms, keep_draws_saved_ms=draws_ms)
        return dataclasses.replace(step, blocks=(block,))

    fitted = Profile((saving(a, -1.0, 0.5), saving(b, 0.5, 1.0))).at(8).blocks[0]
    assert fitted.keep_saved_ms == 9.5 and fitted.keep_draws_saved_ms == 4.0
    below = Profile((saving(a, -1.0, 0.5), saving(b, -2.0, 0.25))).at(4).blocks[0]
    assert below.keep_saved_ms == -4.0 and below.keep_draws_saved_ms == -0.25
    assert Profile((saving(a, -1.0, 0.5), b)).at(8).blocks[0].keep_saved_ms is None
    back = Profile.from_dict(Profile((saving(a, -1.0, None), saving(b, 0.5, None))).to_dict())
    assert back.at(8).blocks[0].keep_saved_ms == 9.5 and back.at(8).blocks[0].keep_draws_saved_ms is None


def test_a_smallest_slice_unlike_the_batch_is_left_out_of_the_line():
    """Batch 1 runs other code (its one sample has no padding, so no mask is built): the line through
    batches 1 and 2 misses the check at 4, and the line through 2 and 4 is used instead."""
    from lightning_ckpt.costs.block_costs import BlockCost, StepCost
    from lightning_ckpt.costs.linear_fit import refit_without_smallest

    def step(b, pre):
        return StepCost(blocks=(BlockCost("b0", saved_bytes=100 * b, input_bytes=10 * b),), batch_size=b, pre_saved_bytes=pre)

    odd = Profile(probes=(step(1, 10), step(2, 100)), check=step(4, 200))
    refit = refit_without_smallest(odd)
    assert [p.batch_size for p in refit.probes] == [2, 4] and refit.check is None
    assert refit.at(8).pre_saved_bytes == 400
    linear = Profile(probes=(step(1, 50), step(2, 100)), check=step(4, 200))
    assert refit_without_smallest(linear) is linear


def _scratch_step(b: int, scratch: int, carried: int = 0) -> StepCost:
    block = BlockCost("b0", saved_bytes=1000 * b, input_bytes=10 * b, bwd_transient_bytes=scratch, carried_bwd_bytes=carried)
    return StepCost(blocks=(block,), batch_size=b, post_saved_bytes=50 * b)


def test_backward_scratch_off_the_line_at_batch_one_refits_and_says_so():
    """Every size the memory model holds is checked, not only saved and boundary bytes: a block's
    backward scratch at batch 1 (attention dropout's, in a ViT) off the line leaves batch 1 out."""
    from lightning_ckpt.costs.linear_fit import refit_without_smallest, relative_miss

    odd = Profile(probes=(_scratch_step(1, 300), _scratch_step(2, 400)), check=_scratch_step(4, 800))
    assert relative_miss(odd.at(4), odd.check) > 0.1
    refit = refit_without_smallest(odd)
    assert [p.batch_size for p in refit.probes] == [2, 4] and refit.at(16).blocks[0].bwd_transient_bytes == 3200
    assert refit.fit_note == (
        "bytes measured at batch 1 are off the line through the larger slices (the line through batches 1 and 2 "
        "missed batch 4 by 25.0%), so the profile is fitted on batches 2 and 4; no larger slice was left to check them"
    )
    again = Profile.from_dict(Profile(refit.probes, _scratch_step(8, 1600)).to_dict())
    assert again.fit_note.endswith("at batch 8 the new lines miss by 0.0%")
    assert odd.fit_note is None
    # off again at 8: batch 2 is left out too, and the note names both
    twice = refit_without_smallest(Profile(refit.probes, _scratch_step(8, 2400)))
    assert [p.batch_size for p in twice.probes] == [4, 8]
    assert twice.fit_note.startswith("bytes measured at batches 1 and 2 are off the line")


def test_a_few_bytes_off_the_line_do_not_refit():
    """A field of a few bytes (the loss's own gradient among the carried ones) is measured against a
    hundredth of the step's activation bytes, not against itself."""
    from lightning_ckpt.costs.linear_fit import refit_without_smallest, relative_miss

    def step(b, carried):
        block = BlockCost("b0", saved_bytes=100_000 * b, input_bytes=1000 * b, carried_bwd_bytes=carried)
        return StepCost(blocks=(block,), batch_size=b)

    noisy = Profile(probes=(step(1, 1304), step(2, 4)), check=step(4, 4))
    assert relative_miss(noisy.at(4), noisy.check) < 0.01
    assert refit_without_smallest(noisy) is noisy


def test_a_profile_of_one_sample_costs_batch_size_one_only_and_survives_a_round_trip():
    one = _step(1, _ops(1))
    profile = Profile(probes=(one, one))
    assert profile.one_size and profile.at(1, static_bytes=7).static_bytes == 7 and profile.at(1).blocks == one.blocks
    assert Profile.from_dict(profile.to_dict()).at(1) == profile.at(1)
    with pytest.raises(ValueError, match=r"made at batch size 1 only .* cannot cost batch size 2"):
        profile.at(2)
    with pytest.raises(ValueError, match=r"a profile needs probes at two different batch sizes"):
        Profile(probes=(one, _step(1, _ops(2))))


def test_answers_are_kept_per_batch_size_and_step_fields_and_bounded():
    """`at` gives the same object when asked again, equal to a fresh profile's answer; other step fields are
    another answer; past `AT_KEPT` batch sizes the oldest answers are dropped (and computed again when asked)."""
    from lightning_ckpt.costs.linear_fit import AT_KEPT

    profile = Profile((_step(1, _ops(1)), _step(2, _ops(2))))
    first = profile.at(8, static_bytes=5)
    assert profile.at(8, static_bytes=5) is first
    assert first == Profile((_step(1, _ops(1)), _step(2, _ops(2)))).at(8, static_bytes=5)
    other = profile.at(8, static_bytes=6)
    assert other is not first and other.static_bytes == 6 and first.static_bytes == 5
    for b in range(10, 10 + AT_KEPT):
        assert profile.at(b).blocks[0].saved_bytes == 100 * b
    assert len(profile._at) == AT_KEPT
    again = profile.at(8, static_bytes=5)
    assert again is not first and again == first
    assert profile == Profile((_step(1, _ops(1)), _step(2, _ops(2))))  # the kept answers are not part of equality


def test_a_write_seen_in_any_probe_is_the_blocks_at_every_batch_size():
    """The Python state a block writes (`unreplayable`) is not on a line: a write seen in one probe only (a
    forward that writes at larger batches) keeps the block at every batch size, as do those of the check."""
    def step(batch: int, writes: tuple[str, ...]) -> StepCost:
        return StepCost(blocks=(BlockCost("b0", saved_bytes=100 * batch, input_bytes=10 * batch, unreplayable=writes),),
                        batch_size=batch)

    profile = Profile((step(1, ()), step(2, ("writes self.n (0 -> 1)",))), check=step(4, ("draws from Python's random",)))
    for b in (1, 2, 8):
        assert profile.at(b).blocks[0].unreplayable == ("writes self.n (0 -> 1)", "draws from Python's random")
    assert Profile((step(1, ()), step(2, ()))).at(8).blocks[0].unreplayable == ()


def test_a_combination_of_costs_keeps_every_write_any_of_them_saw():
    from lightning_ckpt.planning.cost_combination import combine_costs

    def cost(writes: tuple[str, ...], state: int) -> StepCost:
        block = BlockCost("b0", saved_bytes=100, input_bytes=10, unreplayable=writes, written_state_bytes=state)
        return StepCost(blocks=(block,), batch_size=2)

    mixed = combine_costs([cost((), 8), cost(("adds items of self.aux (0 -> 1)",), 16)], [0.5, 0.5]).blocks[0]
    assert mixed.unreplayable == ("adds items of self.aux (0 -> 1)",) and mixed.written_state_bytes == 16


def _backward(batch: int, phases) -> StepCost:
    """A block whose backward has `phases` (rest per sample, gradients made, in flight) at `batch`."""
    stretches = tuple((rest * batch, made, flight) for rest, made, flight in phases)
    unset, kept = backward_phase_peaks(stretches)
    block = BlockCost("b0", saved_bytes=100 * batch, input_bytes=10 * batch, bwd_transient_bytes=unset,
                      kept_grads_bwd_transient_bytes=kept, bwd_phase_bytes=stretches)
    return StepCost(blocks=(block,), batch_size=batch)


# activation gradients of 100 bytes a sample; a weight's gradient (1000 bytes) made beside 10 bytes a sample,
# then written, beside 20 bytes a sample
PHASES = ((100, 0, 0), (10, 1000, 1000), (20, 1000, 0))


def test_each_stretch_of_the_backward_follows_its_own_line():
    """At one and two samples the peak is the weight's gradient's (1020 and 1040 bytes; 1010 and 1020 into kept
    gradients); at sixteen the activations' alone (1600), which the lines through the two peaks miss (1320, 1160)."""
    profile = Profile((_backward(1, PHASES), _backward(2, PHASES)))
    block = profile.at(16).blocks[0]
    assert (block.bwd_transient_bytes, block.kept_grads_bwd_transient_bytes) == (1600, 1600)
    assert block.bwd_phase_bytes == ()
    one = profile.at(1).blocks[0]
    assert (one.bwd_transient_bytes, one.kept_grads_bwd_transient_bytes) == (1020, 1010)
    assert StepCost.from_dict(profile.probes[0].to_dict()) == profile.probes[0]  # the stretches through JSON


def test_stretches_the_probes_cut_differently_fall_back_to_the_lines_of_the_peaks():
    other = ((100, 0, 0), (20, 1000, 0))  # one sample wrote the gradient as it was made
    profile = Profile((_backward(1, other), _backward(2, PHASES)))
    block = profile.at(16).blocks[0]
    low, high = profile.probes[0].blocks[0], profile.probes[1].blocks[0]
    assert block.bwd_transient_bytes == low.bwd_transient_bytes + 15 * (high.bwd_transient_bytes - low.bwd_transient_bytes)
    assert block.kept_grads_bwd_transient_bytes <= block.bwd_transient_bytes


def test_a_backward_into_kept_gradients_never_holds_more_than_one_whose_gradients_stay():
    with pytest.raises(ValueError, match=r"kept_grads_bwd_transient_bytes=5 exceeds bwd_transient_bytes=4"):
        BlockCost("b", saved_bytes=1, input_bytes=1, bwd_transient_bytes=4, kept_grads_bwd_transient_bytes=5)
