"""Gradient accumulation: every micro-batch within the budget, the later ones with the gradients of the
earlier ones alive through their whole backward. HF Llama built from config, bf16-mixed."""

from __future__ import annotations

import lightning.pytorch as pl
from hf_models import CausalTokens, LitHF, StepPeaks, tiny_llama
from lit_models import make_trainer

from lightning_ckpt import ActivationCheckpointing, make_plan

BATCH, ACCUMULATE = 4, 4


def _fit(callbacks, max_steps=2):
    pl.seed_everything(0, verbose=False)
    model = LitHF(tiny_llama())
    peaks = StepPeaks()
    trainer = make_trainer(
        [*callbacks, peaks], max_steps=max_steps, precision="bf16-mixed", accumulate_grad_batches=ACCUMULATE
    )
    trainer.fit(model, datamodule=CausalTokens(BATCH))
    return model, peaks


def test_every_micro_batch_fits_and_the_plan_counts_the_accumulated_gradients():
    probe = ActivationCheckpointing(BATCH, memory_budget="1GiB", policy="none", verbose=False, report=False)
    _fit([probe], max_steps=1)
    assert probe.cost.grads_accumulate
    none = make_plan(probe.cost, "none").predicted_peak_bytes
    full = make_plan(probe.cost, "full").predicted_peak_bytes
    budget = (none + full) // 2
    cb = ActivationCheckpointing(BATCH, memory_budget=budget, verbose=False, report=False)
    _, peaks = _fit([cb], max_steps=2)
    assert len(peaks.peaks) == 2 * ACCUMULATE
    assert cb.plan.segments, "the budget should need some checkpointing"
    over = [(i, p) for i, p in enumerate(peaks.peaks) if p > budget]
    assert not over, f"micro-batches over the budget of {budget} bytes: {over}"
    # the accumulating micro-batches (not the first of a window) hold more than the first ones
    assert max(peaks.peaks[5:8]) > peaks.peaks[4]
