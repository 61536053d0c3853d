"""Manual optimization end to end: the plan is made from the module's own `training_step`, whose
`manual_backward`, optimizer and scheduler steps do nothing while it is profiled, so training
matches a run without the callback bit for bit, also with several passes per step."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lit_models import (
    LitManual,
    LitNoBackward,
    LitTwoPasses,
    SeededTokenData,
    assert_same_state,
    make_trainer,
    training_state,
)

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.planning.policies import make_plan


def _fit(model, callbacks, max_steps=3, data=None):
    trainer = make_trainer(callbacks, max_steps=max_steps)
    trainer.fit(model, datamodule=data or SeededTokenData(batch_size=8))
    return trainer


def _callback(budget, blocks=None):
    return ActivationCheckpointing(target_batch_size=8, memory_budget=budget, blocks=blocks, verbose=False, report=False)


@pytest.fixture(scope="module")
def budget():
    """Half way between the predicted peaks of `none` and `full` at batch 8: some blocks are checkpointed."""
    pl.seed_everything(0, verbose=False)
    probe = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="none", verbose=False, report=False)
    _fit(LitManual(), [probe], max_steps=1)
    none = make_plan(probe.cost, "none").predicted_peak_bytes
    full = make_plan(probe.cost, "full").predicted_peak_bytes
    assert full < none
    return (none + full) // 2


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"n_optimizers": 2}, {"scheduler": True}, {"n_optimizers": 2, "scheduler": True, "toggle": True}],
    ids=["one_optimizer", "two_optimizers", "scheduler", "toggled_two_optimizers_and_scheduler"],
)
def test_manual_steps_bit_identical_to_no_callback(budget, kwargs):
    """Losses, parameters, optimizer and scheduler state and Lightning's counters after the fit
    equal those of the same fit without the callback; the plan checkpoints some blocks."""
    pl.seed_everything(0, verbose=False)
    model, cb = LitManual(**kwargs), _callback(budget)
    trainer = _fit(model, [cb])
    pl.seed_everything(0, verbose=False)
    reference = LitManual(**kwargs)
    plain = _fit(reference, [])

    assert cb.plan.fits and 0 < len(cb.plan.checkpointed) < 6
    assert len(model.losses) == len(reference.losses) >= 2
    for a, b in zip(model.losses, reference.losses):
        assert torch.equal(a, b)
    assert trainer.global_step == plain.global_step == 3 + (kwargs.get("n_optimizers", 1) == 2)
    assert trainer.fit_loop.state_dict() == plain.fit_loop.state_dict()
    assert_same_state(training_state(reference), training_state(model))


@pytest.mark.parametrize("passes", ["forwards", "backwards"])
def test_several_manual_backward_calls_train_bit_identically(passes):
    """Two forward/backward passes per step (the network run and stepped twice), or two losses of one
    forward each given to `manual_backward`: profiled as one backward through both (their graphs alive
    together, which the step never exceeds), planned over every block call, trained as without the callback."""
    pl.seed_everything(0, verbose=False)
    probe = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="none", verbose=False, report=False)
    _fit(LitTwoPasses(passes=passes), [probe], max_steps=1)
    none, full = (make_plan(probe.cost, p).predicted_peak_bytes for p in ("none", "full"))
    names = [r.name for r in make_plan(probe.cost, "none").rows]
    calls = 2 if passes == "forwards" else 1
    assert len(names) == 6 * calls and (calls == 1 or names[6] == "net.blocks.0#1")
    pl.seed_everything(0, verbose=False)
    reference = LitTwoPasses(passes=passes)
    plain = _fit(reference, [])
    pl.seed_everything(0, verbose=False)
    model, cb = LitTwoPasses(passes=passes), _callback((none + full) // 2)
    trainer = _fit(model, [cb])
    assert cb.plan.fits and cb.plan.checkpointed
    assert len(model.losses) == len(reference.losses) >= 2
    assert all(torch.equal(a, b) for a, b in zip(model.losses, reference.losses))
    assert trainer.global_step == plain.global_step
    assert_same_state(training_state(reference), training_state(model))


def test_step_without_backward_or_loss_refused(budget):
    with pytest.raises(ValueError, match=r"neither called self\.manual_backward\(loss\) nor returned a loss"):
        _fit(LitNoBackward(), [_callback(budget)])


def test_methods_replaced_while_profiling_are_put_back(budget):
    """`manual_backward`, the optimizers' `step` and `zero_grad` and the scheduler's `step` are the
    ones from before profiling, including the `step` wrapper torch's scheduler puts on its optimizer."""
    model = LitManual(n_optimizers=2, scheduler=True)
    trainer = _fit(model, [_callback(budget)], max_steps=1)
    assert "manual_backward" not in vars(model)
    for opt in trainer.strategy._lightning_optimizers:
        assert "step" not in vars(opt) and "zero_grad" not in vars(opt)
    first, second = trainer.optimizers
    assert getattr(vars(first)["step"], "_wrapped_by_lr_sched", False) and "step" not in vars(second)
    assert "zero_grad" not in vars(first) and "zero_grad" not in vars(second)
    (scheduler,) = (c.scheduler for c in trainer.lr_scheduler_configs)
    assert "step" not in vars(scheduler) and scheduler.last_epoch == 1
