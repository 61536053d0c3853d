"""HF T5, Llama and GPT-NeoX as their configs ship (`use_cache=True`) under the callback, with segments of several
blocks and with nested segments: every step within the budget, predicted within 3 %, no growth over 7
steps, losses those of the run without checkpointing, and `use_cache` back to True after fit; and HF's own
gradient checkpointing, enabled beforehand, taken over for the fit and restored."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import zoo_models
from hf_models import LitHF, StepPeaks
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.engine.model_prep import ModelCompatWarning

STEPS, BATCH = 7, 8
SIZES = {"several_blocks": {}, "nested": {"layers": 8, "seq": 128}}  # long enough that boundaries dominate `full`


def _chain(entry):
    """The entry's chain as paths under `LitHF` (which holds the model as `model`)."""
    return f"model.{entry.chain}" if isinstance(entry.chain, str) else [f"model.{c}" for c in entry.chain]


def _loader(entry, steps: int = STEPS) -> DataLoader:
    batches = [entry.batch(BATCH, seed=0)] * steps  # one batch again and again: the steps must not grow
    return DataLoader(batches, batch_size=None)


def _fit(name: str, sizes: dict, steps: int = STEPS, **callback):
    pl.seed_everything(0, verbose=False)
    entry = getattr(zoo_models, name)(**sizes)
    module = LitHF(entry.model)
    peaks = StepPeaks()
    callbacks = [peaks]
    cb = None
    if callback:
        settings = {"blocks": _chain(entry), "cost_metric": "flops", **callback}
        cb = ActivationCheckpointing(target_batch_size=BATCH, verbose=False, report=False, **settings)
        callbacks.insert(0, cb)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=_loader(entry, steps))
    told = [str(w.message) for w in caught if issubclass(w.category, ModelCompatWarning) or "use_cache" in str(w.message)]
    return entry, module, cb, peaks.peaks, told


def _budget(name: str, share: float, sizes: dict) -> int:
    from zoo_check import budget_between

    torch.manual_seed(0)
    entry = getattr(zoo_models, name)(**sizes)
    return budget_between(entry, entry.batch(BATCH, seed=0), share)


@pytest.mark.parametrize("name", ["t5", "llama"])
@pytest.mark.parametrize("form", ["several_blocks", "nested"])
def test_default_config_trains_within_the_budget_without_growth(name, form):
    if form == "several_blocks":
        settings = {"policy": "every_k", "every_k": 2, "memory_budget": _budget(name, 1.0, SIZES[form])}
    else:  # below `full`'s peak: only segments rebuilt inside segments fit
        settings = {"memory_budget": _budget(name, 0.0, SIZES[form]) - 1}
    _, plain_module, _, _, _ = _fit(name, SIZES[form])
    entry, module, cb, peaks, told = _fit(name, SIZES[form], **settings)
    plan = cb.plan
    if form == "several_blocks":
        assert any(b > a for a, b in plan.segments), plan.segments
    else:
        assert plan.inner_segments, plan
    assert all(torch.equal(a, b) for a, b in zip(module.losses, plain_module.losses)) and len(module.losses) == STEPS
    steady = peaks[1:]  # the first step has no optimizer state yet
    assert max(steady) == min(steady), f"the step's peak grew: {peaks}"
    assert max(peaks) <= settings["memory_budget"]
    assert abs(plan.predicted_peak_bytes - max(steady)) <= 0.03 * max(steady), (plan.predicted_peak_bytes, peaks)
    assert entry.model.config.use_cache is True  # put back after fit
    assert sum("use_cache=False" in m for m in told) == 1, told  # said once


def test_gpt_neox_whose_config_is_no_decoder_has_its_cache_off_and_stays_within_the_budget_at_defaults():
    """GPT-NeoX's config says `is_decoder=False` with `use_cache=True`: its forward fills a cache all the same,
    which every recompute would extend. At the callback's defaults (the chain found, cost in time) every step is
    within the budget by the tests' own tracker, and the losses are those of the run without the callback."""
    sizes, steps = {"layers": 3}, 4
    budget = _budget("gpt_neox", 0.5, sizes)
    _, plain_module, _, _, _ = _fit("gpt_neox", sizes, steps)
    entry, module, cb, peaks, told = _fit("gpt_neox", sizes, steps, memory_budget=budget, blocks=None, cost_metric="time")
    assert entry.model.config.is_decoder is False and entry.model.config.use_cache is True  # put back after fit
    assert cb.block_names[0].startswith("model.gpt_neox.layers") and cb.plan.segments, (cb.block_names, cb.plan)
    assert len(module.losses) == steps and all(torch.equal(a, b) for a, b in zip(module.losses, plain_module.losses))
    assert max(peaks) <= budget, (peaks, budget)
    assert max(peaks[1:]) == min(peaks[1:]), f"the step's peak grew: {peaks}"
    assert sum("use_cache=False" in m for m in told) == 1, told


def test_hf_gradient_checkpointing_enabled_beforehand_is_ours_for_the_fit_and_restored():
    entry = zoo_models.llama()
    entry.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = entry.model.model.layers
    before = [layer.__dict__.get("gradient_checkpointing") for layer in layers]
    module = LitHF(entry.model)
    budget = _budget("llama", 0.5, {})
    cb = ActivationCheckpointing(target_batch_size=BATCH, memory_budget=budget, blocks=_chain(entry),
                                 cost_metric="flops", verbose=False, report=False)
    calls = []
    original = entry.model._gradient_checkpointing_func if hasattr(entry.model, "_gradient_checkpointing_func") else None

    class During(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            calls.append([layer.__dict__.get("gradient_checkpointing") for layer in layers])

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, During()])
    with pytest.warns(UserWarning, match=r"HF activation checkpointing was on .* turned off for this fit"):
        trainer.fit(module, train_dataloaders=_loader(entry))
    assert cb.plan.segments and all(not any(flags) for flags in calls)  # ours ran, HF's was off
    assert [layer.__dict__.get("gradient_checkpointing") for layer in layers] == before and any(before)
    assert original is None or entry.model._gradient_checkpointing_func is original
