"""Gradient accumulation: every micro-batch within the budget, the later ones with the gradients of the
earlier ones alive through their whole backward (HF Llama built from config, bf16-mixed), and a
`GradientAccumulationScheduler` that turns accumulation on during the fit re-plans. Each micro-batch is
measured by a live-bytes tracker of the test's own, apart from the callback's accounting."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
from hf_models import CausalTokens, LitHF, tiny_llama
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lit_models import LitChain, TokenData, make_trainer
from models import tokens_batch
from test_checkpoint_engine import _engine

from lightning_ckpt import ActivationCheckpointing, make_plan
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.profiling.batch import tensors_in
from lightning_ckpt.profiling.step_peak import state_tensors
from lightning_ckpt.profiling.tracker import LiveBytesTracker

BATCH, ACCUMULATE = 4, 4
CHAIN_BATCH = 16  # the chain test: probes of 1, 2 and 4 samples profile far within its budget


class MicroBatchPeaks(pl.Callback):
    """The peak live bytes of every micro-batch, from its batch start to its batch end (the optimizer
    step included when it has one): parameters, buffers, gradients, optimizer state and the batch
    adopted at its start. Listed after `ActivationCheckpointing`, so the plan is in place first."""

    def __init__(self, checkpointing: ActivationCheckpointing | None = None) -> None:
        self.checkpointing = checkpointing
        self.peaks: list[int] = []
        self.accumulate: list[int] = []  # `accumulate_grad_batches` at each micro-batch
        self.plans: list = []  # the plan `checkpointing` applied at each micro-batch
        self._tracker: LiveBytesTracker | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._tracker = LiveBytesTracker().__enter__()
        self._tracker.adopt(state_tensors(pl_module, trainer.optimizers[0]) + list(tensors_in(batch)))
        self._tracker.reset_peak()
        self.accumulate.append(trainer.accumulate_grad_batches)
        if self.checkpointing is not None:
            self.plans.append(self.checkpointing.plan)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._tracker.__exit__(None, None, None)
        self.peaks.append(self._tracker.peak_bytes)


def _fit(callbacks, max_steps=2):
    pl.seed_everything(0, verbose=False)
    model = LitHF(tiny_llama())
    peaks = MicroBatchPeaks()
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


# ----------------------------------------------------------------------------- accumulation turned on in the fit


def _chain_fit(callbacks, max_steps):
    """LitChain on 4 batches an epoch: with accumulation 4 from epoch 1, 4 steps then 1 step of 4 micro-batches."""
    pl.seed_everything(0, verbose=False)
    model = LitChain(n_blocks=4, d=64)
    data = TokenData(CHAIN_BATCH, n=4 * CHAIN_BATCH)
    make_trainer(callbacks, max_steps=max_steps, limit_train_batches=4).fit(model, datamodule=data)


def test_a_scheduler_that_turns_accumulation_on_re_plans_and_every_micro_batch_fits(caplog):
    probe = ActivationCheckpointing(CHAIN_BATCH, memory_budget="1GiB", policy="none", verbose=False, report=False)
    _chain_fit([probe], max_steps=1)
    plain = probe.cost
    accumulating = dataclasses.replace(plain, grads_accumulate=True)
    # binding with the gradients of earlier micro-batches alive or not (nothing checkpointed fits neither
    # way), and near enough to `full` that they change the plan
    full, none = (make_plan(accumulating, p).predicted_peak_bytes for p in ("full", "none"))
    budget = full + (none - full) // 5
    assert make_plan(plain, "none").predicted_peak_bytes > budget
    cb = ActivationCheckpointing(CHAIN_BATCH, memory_budget=budget, verbose=False, report=False)
    peaks = MicroBatchPeaks(cb)
    with caplog.at_level("INFO"):
        _chain_fit([cb, GradientAccumulationScheduler({0: 1, 1: ACCUMULATE}), peaks], max_steps=5)
    assert peaks.accumulate == [1] * 4 + [ACCUMULATE] * 4
    over = [(i, p) for i, p in enumerate(peaks.peaks) if p > budget]
    assert not over, f"micro-batches over the budget of {budget} bytes: {over}"
    stale, replanned = peaks.plans[0], peaks.plans[-1]
    assert stale.segments and all(p is stale for p in peaks.plans[:4]) and all(p is replanned for p in peaks.plans[4:])
    # the plan made at accumulation 1 would run over with the gradients alive: re-planning was needed
    assert predict_peak(accumulating, stale.segments, stale.keeps, stale.inner_segments).peak_bytes > budget
    assert cb.cost.grads_accumulate and replanned.segments != stale.segments
    said = [r.getMessage() for r in caplog.records if "gradient accumulation turned on" in r.getMessage()]
    assert len(said) == 1 and "planned again" in said[0]
    # the later micro-batches of the window hold the earlier ones' gradients: more than the first
    assert max(peaks.peaks[5:]) > peaks.peaks[4]


def test_the_engine_drops_its_plans_when_accumulation_changes_and_keeps_the_profiles():
    engine, driver = _engine(policy="none")
    batch = tokens_batch(8, 12)
    assert engine.step(batch) is not None and not engine.cost.grads_accumulate
    assert engine.step(batch) is None  # in place
    driver.grads_accumulate = True
    again = engine.step(batch)
    assert again is not None and again.new and engine.cost.grads_accumulate
    assert len(driver.profiled) == 1  # planned again from the profile, not profiled again
    assert sum("turned on" in m for m in driver.messages) == 1
    assert engine.step(batch) is None  # said once; the new plan stays in place
    driver.grads_accumulate = False
    assert engine.step(batch) is not None and not engine.cost.grads_accumulate
    assert sum("turned off" in m for m in driver.messages) == 1
    engine.remove()
