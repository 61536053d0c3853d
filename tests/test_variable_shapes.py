"""Every batch within the budget when its shape changes: HF BERT built from config, batches padded per
batch by `DataCollatorWithPadding` (`BatchEncoding`s), each step measured as a whole."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from hf_models import LitHF, PaddedTextData, StepPeaks, tiny_bert
from lit_models import make_trainer

from lightning_ckpt import ActivationCheckpointing, InfeasibleBudgetError, make_plan

BATCH = 8
SHORT_FIRST = [16, 16, 64, 32, 64, 16, 48, 64]  # first batch at 16, later ones up to 4x longer


def _fit(lengths, callbacks, seed=0, max_steps=None):
    pl.seed_everything(seed, verbose=False)
    model = LitHF(tiny_bert())
    peaks = StepPeaks()
    trainer = make_trainer([*callbacks, peaks], max_steps=max_steps or len(lengths))
    trainer.fit(model, datamodule=PaddedTextData(lengths, BATCH, seed))
    return model, peaks, trainer


def _peaks_at(length: int):
    """The `none` and `full` peaks at one length, from the callback's own prediction."""
    probe = ActivationCheckpointing(BATCH, memory_budget="1GiB", policy="none", verbose=False, report=False)
    _fit([length], [probe], max_steps=1)
    return make_plan(probe.cost, "none").predicted_peak_bytes, make_plan(probe.cost, "full").predicted_peak_bytes


@pytest.fixture(scope="module")
def budget():
    """Half way between `none` and `full` at the longest length: some blocks must be checkpointed there,
    none at the shortest."""
    none_long, full_long = _peaks_at(64)
    none_short, _ = _peaks_at(16)
    mid = (none_long + full_long) // 2
    assert none_short < mid, "the short batches should need no checkpointing at this budget"
    return mid


def test_every_step_fits_with_short_batches_first_and_losses_are_bit_identical(budget):
    cb = ActivationCheckpointing(BATCH, memory_budget=budget, verbose=False, report=False)
    model, peaks, _ = _fit(SHORT_FIRST, [cb])
    assert len(peaks.peaks) == len(SHORT_FIRST)
    for shape, peak in zip(peaks.shapes, peaks.peaks):
        assert peak <= budget, f"step at {shape} peaked at {peak} bytes, over the budget of {budget}"
    plain, _, _ = _fit(SHORT_FIRST, [])
    assert len(model.losses) == len(plain.losses)
    for a, b in zip(model.losses, plain.losses):
        assert torch.equal(a, b)
    # each shape ran its own plan: the short batches none, the long ones some checkpointing
    by_length = {s.shapes[0][1]: p for s, p in cb.plans.items()}
    assert not by_length[16].segments
    assert by_length[64].segments
    assert all(p.fits for p in by_length.values())
    # profiled once per length at most (BERT drops its attention mask when a prefix has no padding, so prefixes
    # of a long batch do not stand in for real short ones here), never again when a length comes back
    assert cb.profiled_steps <= len(set(SHORT_FIRST))


def test_long_batches_first_then_short_ones_drop_their_checkpointing(budget):
    lengths = [64, 64, 16, 16, 32]
    cb = ActivationCheckpointing(BATCH, memory_budget=budget, verbose=False, report=False)
    _, peaks, _ = _fit(lengths, [cb])
    assert all(p <= budget for p in peaks.peaks)
    by_length = {s.shapes[0][1]: p for s, p in cb.plans.items()}
    assert by_length[64].segments and not by_length[16].segments


def test_a_shape_no_plan_can_fit_stops_before_its_step(budget):
    """A budget between `full` at the short length and `full` at the long one: the long batch cannot fit."""
    _, full_short = _peaks_at(16)
    _, full_long = _peaks_at(64)
    tight = (full_short + full_long) // 2
    cb = ActivationCheckpointing(BATCH, memory_budget=tight, verbose=False, report=False)
    pl.seed_everything(0, verbose=False)
    model = LitHF(tiny_bert())
    peaks = StepPeaks()
    trainer = make_trainer([cb, peaks], max_steps=4)
    with pytest.raises(InfeasibleBudgetError, match=r"shape \(batch 8, tensors \[8, 64\]"):
        trainer.fit(model, datamodule=PaddedTextData([16, 16, 64, 16], BATCH))
    assert len(peaks.peaks) == 2, "the two short steps ran, the long one did not start"
    assert all(p <= tight for p in peaks.peaks)


def test_a_second_fit_on_longer_sequences_stays_within_the_budget(budget):
    cb = ActivationCheckpointing(BATCH, memory_budget=budget, verbose=False, report=False)
    pl.seed_everything(0, verbose=False)
    model = LitHF(tiny_bert())
    first = StepPeaks()
    make_trainer([cb, first], max_steps=2).fit(model, datamodule=PaddedTextData([16, 16], BATCH))
    assert not cb.plan.segments
    second = StepPeaks()
    make_trainer([cb, second], max_steps=3).fit(model, datamodule=PaddedTextData([64, 64, 48], BATCH))
    assert len(second.peaks) == 3 and all(p <= budget for p in second.peaks)
    assert cb.plan.segments
