"""One `ActivationCheckpointing` serving several fits, as cross-validation folds, searches and notebooks use
it: a new HF BERT (built from config) at a new sequence length, the same model fitted again with
`validate`/`test` between, and a fit that fails half way. Each fit plans as the first did; every step of
it is measured by a live-bytes tracker of the test's own (`MicroBatchPeaks`), apart from the callback's
accounting, and after each fit the model is as it was before: module tree, state_dict keys, hooks, forward,
HF settings."""

from __future__ import annotations

import gc
import weakref

import lightning.pytorch as pl
import pytest
import torch
from hf_models import LitHF, PaddedTextData, tiny_bert
from lit_models import make_trainer
from test_accumulation import MicroBatchPeaks

from lightning_ckpt import ActivationCheckpointing, make_plan

BATCH = 4
SHORT, LONG = 64, 128
BLOCKS = "model.bert.encoder.layer"


class LitHFEval(LitHF):
    """`LitHF` with the loss as validation and test metric."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model(**batch).loss)


class TextData(PaddedTextData):
    """Padded text batches for training, validation and testing alike."""

    def val_dataloader(self):
        return self.train_dataloader()

    def test_dataloader(self):
        return self.train_dataloader()


def _model(seed: int = 0, cls=LitHF) -> LitHF:
    pl.seed_everything(seed, verbose=False)
    return cls(tiny_bert())


def _fit(model: LitHF, length: int, callbacks=(), steps: int = 3, seed: int = 0, measure: bool = True) -> MicroBatchPeaks:
    """`steps` steps on batches of `length` tokens, every one measured unless `measure` is False (a fit that
    fails in a step leaves the tracker's dispatch mode open); the seed set as for a fit on its own."""
    peaks = MicroBatchPeaks()
    trainer = make_trainer([*callbacks, *([peaks] if measure else [])], max_steps=steps)
    pl.seed_everything(seed, verbose=False)
    trainer.fit(model, datamodule=PaddedTextData([length] * steps, BATCH))
    assert len(peaks.peaks) == (steps if measure else 0)
    return peaks


def _as_it_was(model: torch.nn.Module) -> dict:
    """What a fit may change on the model and must put back."""
    return {
        "modules": [(name, type(m).__name__) for name, m in model.named_modules()],
        "state_dict": list(model.state_dict()),
        "hooks": [
            (name, len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_pre_hooks), len(m._backward_hooks))
            for name, m in model.named_modules()
        ],
        "forward": [name for name, m in model.named_modules() if "forward" in vars(m)],
        "use_cache": model.model.config.use_cache,
        "hf_checkpointing": model.model.is_activation_checkpointing,
    }


def _dispatch_modes() -> list[str]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [type(m).__name__ for m in _get_current_dispatch_mode_stack()]


def _callback(budget: int, blocks: str | None = BLOCKS) -> ActivationCheckpointing:
    return ActivationCheckpointing(BATCH, memory_budget=budget, blocks=blocks, verbose=False, report=False)


@pytest.fixture(scope="module")
def budget() -> int:
    """Half way between the `full` and `none` peaks at the long length: some blocks must be checkpointed
    there. From the callback's own prediction, on a model of its own."""
    probe = ActivationCheckpointing(BATCH, memory_budget="1GiB", blocks=BLOCKS, policy="none", verbose=False, report=False)
    _fit(_model(), LONG, [probe], steps=1)
    none, full = (make_plan(probe.cost, p).predicted_peak_bytes for p in ("none", "full"))
    return (none + full) // 2


@pytest.mark.parametrize("blocks", [BLOCKS, None], ids=["named", "found"])
def test_a_new_model_at_a_new_length_plans_afresh_fits_and_trains_bit_identically(budget, blocks):
    cb = _callback(budget, blocks)
    first = _model(seed=1)
    before = _as_it_was(first)
    _fit(first, SHORT, [cb], steps=2)
    assert _as_it_was(first) == before
    assert all(s.shapes[0][1] == SHORT for s in cb.plans)

    second = _model(seed=0)
    peaks = _fit(second, LONG, [cb])
    over = [p for p in peaks.peaks if p > budget]
    assert not over, f"steps of the second fit peaked at {over} bytes, over the budget of {budget}"
    assert cb.plan.segments and cb.plan.fits  # at this length some blocks are checkpointed
    assert [s.shapes[0][1] for s in cb.plans] == [LONG]  # nothing of the first fit's shapes kept
    assert cb.profiled_steps == 1  # the new model was profiled, as in a first fit
    assert cb.measured_peak_bytes is not None and cb.measured_peak_bytes <= budget  # the second fit's own

    plain = _model(seed=0)
    _fit(plain, LONG)
    assert len(second.losses) == len(plain.losses) == 3
    assert all(torch.equal(a, b) for a, b in zip(second.losses, plain.losses))


def test_the_same_model_fitted_twice_with_validate_and_test_between(budget):
    cb = _callback(budget)
    model = _model(cls=LitHFEval)
    before = _as_it_was(model)
    _fit(model, SHORT, [cb], steps=2)
    assert _as_it_was(model) == before
    data = TextData([LONG], BATCH)
    for run in ("validate", "test"):
        trainer = make_trainer([cb])
        getattr(trainer, run)(model, datamodule=data, verbose=False)
        assert _as_it_was(model) == before, run

    peaks = _fit(model, LONG, [cb])
    assert all(p <= budget for p in peaks.peaks), f"{peaks.peaks} over the budget of {budget}"
    assert cb.plan.segments and [s.shapes[0][1] for s in cb.plans] == [LONG]
    assert _as_it_was(model) == before

    again = _fit(model, SHORT, [cb], steps=2)  # and back at the first length: planned again, within the budget
    assert all(p <= budget for p in again.peaks) and [s.shapes[0][1] for s in cb.plans] == [SHORT]
    assert _as_it_was(model) == before


class FailsAtStep1(LitHF):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 1:
            raise RuntimeError("stop at step 1")
        return super().training_step(batch, batch_idx)


class FailsOnSlices(LitHF):
    """Profiling runs the step on slices of the first batch: here they fail."""

    def training_step(self, batch, batch_idx):
        if len(batch["input_ids"]) < BATCH:
            raise RuntimeError("no slices here")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("where", ["in_a_step", "in_planning"])
def test_a_fit_that_fails_half_way_leaves_the_model_as_it_was_and_the_next_fit_plans_afresh(budget, where):
    cb = _callback(budget)
    # in a step: the plan applied, use_cache off and the step measured; in planning: the model prepared, no plan yet
    failing = _model(cls=FailsAtStep1 if where == "in_a_step" else FailsOnSlices)
    before = _as_it_was(failing)
    with pytest.raises(RuntimeError, match="stop at step 1" if where == "in_a_step" else "no slices here"):
        _fit(failing, LONG, [cb], measure=False)
    assert _as_it_was(failing) == before and _dispatch_modes() == []  # the callback's own step tracker closed

    model = _model(seed=2)
    peaks = _fit(model, SHORT, [cb], steps=2)
    assert all(p <= budget for p in peaks.peaks) and [s.shapes[0][1] for s in cb.plans] == [SHORT]


def test_after_a_fit_the_callback_keeps_neither_the_model_nor_its_trainer(budget):
    cb = _callback(budget)
    model = _model()
    _fit(model, LONG, [cb], steps=2)
    plan = cb.plan
    gone = weakref.ref(model)
    for name in ("log", "log_dict"):  # the module's methods, put on every callback by the Trainer
        vars(cb).pop(name, None)
    del model
    gc.collect()
    assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    assert cb.plan is plan and plan.segments  # what the fit planned stays readable
