"""Probe sizes against the first training batch: too large raises, a check size too large is skipped.
Profiling the first batch leaves the model, the optimizers, the RNG streams and Lightning's counters
as found, also when it fails at any stage."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lit_models import (
    FirstBatchState,
    LitChain,
    LitKeptOptimizer,
    LitManual,
    SeededTokenData,
    assert_same_state,
    make_trainer,
    training_state,
    with_optimizer_state,
)

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.frontends.lightning.profile_step import probe_sizes
from lightning_ckpt.planning.policies import make_plan


def _batch(n: int):
    return torch.zeros(n, 3), torch.zeros(n, dtype=torch.long)


def test_sizes_within_the_batch_are_used_as_given():
    assert probe_sizes(_batch(8), (1, 2), 4) == 4
    assert probe_sizes(_batch(2), (1, 2), None) is None


@pytest.mark.parametrize(
    ("n", "probes", "match"),
    [
        (4, (8, 16), (r"^probe_batch_sizes=\(8, 16\) but the first training batch has 4 samples; the probes are "
                      r"slices of that batch\. Set probe_batch_sizes to two sizes <= 4, e\.g\. \(1, 2\)\.$")),
        (3, (1, 4), r"probe_batch_sizes=\(1, 4\) but the first training batch has 3 samples"),
    ],
)
def test_probe_larger_than_the_batch_raises(n, probes, match):
    with pytest.raises(ValueError, match=match):
        probe_sizes(_batch(n), probes, None)


def test_a_batch_of_one_sample_is_profiled_whole_with_no_check_slice():
    assert probe_sizes(_batch(1), (1, 2), 4) is None  # profiled along its tokens (`engine.length_profiles`)


def test_check_larger_than_the_batch_is_skipped_and_said(caplog):
    with caplog.at_level(logging.INFO):
        assert probe_sizes(_batch(3), (1, 2), 4) is None
    assert "check_batch_size=4 is larger than the first training batch (3 samples)" in caplog.text


# ----------------------------------------------------------------------------- state through a fit


def _fit(model, callbacks, data, max_steps=3):
    trainer = make_trainer(callbacks, max_steps=max_steps)
    trainer.fit(model, datamodule=data)
    return trainer


@pytest.fixture(scope="module")
def budget():
    """Half way between the predicted peaks of `none` and `full` at batch 8: some blocks are checkpointed."""
    probe = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="none", verbose=False, report=False)
    _fit(LitChain(), [probe], SeededTokenData(batch_size=8), max_steps=1)
    return (make_plan(probe.cost, "none").predicted_peak_bytes + make_plan(probe.cost, "full").predicted_peak_bytes) // 2


def _raise(*args, **kwargs):
    raise RuntimeError("injected failure")


def _inject(stage: str, model, monkeypatch) -> None:
    """A failure at `stage` of the first batch's profiling (or of the planning right after it)."""
    block = model.net.blocks[3]
    if stage == "block_forward":  # in the first probe, after three blocks ran
        block.register_forward_pre_hook(_raise)
    elif stage == "backward":  # in the first probe's backward, after three blocks' backward ran

        def on_output(module, args, out):
            if out.requires_grad:
                out.register_hook(_raise)

        block.register_forward_hook(on_output)
    elif stage == "check_probe":  # the probes slice 1 and 2 samples, the check 4
        block.register_forward_pre_hook(lambda module, args: _raise() if args[0].shape[0] == 4 else None)
    elif stage == "rates":
        monkeypatch.setattr("lightning_ckpt.profiling.machine.rates.measure_rates", _raise)
    elif stage == "planning":
        monkeypatch.setattr("lightning_ckpt.engine.checkpoint_engine.plan_for_target", _raise)
    else:
        raise AssertionError(stage)


@pytest.mark.parametrize("optimization", ["automatic", "manual"])
@pytest.mark.parametrize("stage", ["block_forward", "backward", "check_probe", "rates", "planning"])
def test_failed_profiling_leaves_everything_as_found(budget, monkeypatch, stage, optimization):
    """Parameters, buffers, gradients, the optimizers' and scheduler's state, RNG streams, train
    modes, `requires_grad` (manual: raised inside `toggle_optimizer`) and Lightning's counters
    are as they were before the failed fit, bit for bit."""
    data = SeededTokenData(batch_size=8)
    pl.seed_everything(0, verbose=False)
    model = LitKeptOptimizer() if optimization == "automatic" else LitManual(n_optimizers=2, scheduler=True, toggle=True)
    with_optimizer_state(model, data.ds[:8])
    before = training_state(model)
    state = FirstBatchState(grads={n: p.grad for n, p in model.named_parameters()})
    _inject(stage, model, monkeypatch)
    with pytest.raises(RuntimeError, match="injected failure"):
        _fit(model, [state, ActivationCheckpointing(target_batch_size=8, memory_budget=budget, verbose=False)], data)
    assert model.losses == []
    assert_same_state(before, training_state(model))
    assert state.at_exception["progress"] == state.at_start["progress"]
    assert state.at_start["progress"]["global_step"] == 0


def test_max_batch_leaves_rng_as_found_and_trains_as_a_plain_run(budget, monkeypatch):
    """target_batch_size='max' looks at one batch of a loader that shuffles with torch's generator,
    with dropout on: that look leaves torch's RNG as found, training starts from the RNG state of a
    run without the callback at the batch size chosen, and its losses are that run's."""
    from lightning_ckpt.frontends.lightning import loader_batch_size

    looks = []
    first_train_batch = loader_batch_size.first_train_batch

    def looked(trainer):
        before = torch.get_rng_state()
        batch = first_train_batch(trainer)
        looks.append(torch.equal(before, torch.get_rng_state()))
        return batch

    monkeypatch.setattr(loader_batch_size, "first_train_batch", looked)

    class RngAtTrainStart(Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = torch.get_rng_state()

    at_start, plain_at_start = RngAtTrainStart(), RngAtTrainStart()
    cb = ActivationCheckpointing(target_batch_size="max", memory_budget=budget, verbose=False, report=False)
    pl.seed_everything(0, verbose=False)
    model = LitChain()
    _fit(model, [cb, at_start], SeededTokenData(batch_size=8, n=256, shuffle=True, seed=None))
    assert looks == [True]
    assert cb.plan.checkpointed and cb.batch_size > 8

    pl.seed_everything(0, verbose=False)
    plain = LitChain()
    _fit(plain, [plain_at_start], SeededTokenData(batch_size=cb.batch_size, n=256, shuffle=True, seed=None))
    assert torch.equal(at_start.state, plain_at_start.state)
    assert len(model.losses) == len(plain.losses) == 3
    for a, b in zip(model.losses, plain.losses):
        assert torch.equal(a, b)


class _LitWritesParameters(LitChain):
    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.net.head.bias.mul_(1.0)
        return super().training_step(batch, batch_idx)


def test_parameter_written_in_place_while_profiling_raises(budget):
    with pytest.raises(RuntimeError, match=r"^the training step modified 1 parameter\(s\) in place during profiling "
                                           r"\(net\.head\.bias\); lightning-ckpt runs it on slices"):
        _fit(_LitWritesParameters(), [ActivationCheckpointing(target_batch_size=8, memory_budget=budget)],
             SeededTokenData(batch_size=8))
