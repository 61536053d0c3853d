"""Manual optimization end to end: the plan is made from the module's own `training_step`, whose
`manual_backward`, optimizer and scheduler steps do nothing while it is profiled, so training
matches a run without the callback bit for bit; a step with several passes is refused before
any step runs, with everything as it was before fit."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lit_models import (
    FirstBatchState,
    LitManual,
    LitNoBackward,
    LitTwoPasses,
    SeededTokenData,
    assert_same_state,
    make_trainer,
    training_state,
    with_optimizer_state,
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


@pytest.mark.parametrize(
    ("passes", "blocks", "match"),
    [
        ("forwards", "net.blocks", r"^training_step runs block 'net\.blocks\.0' more than once per step \(several "
                                   r"forward/backward passes, as GANs do\); lightning-ckpt plans one forward and one backward"),
        # blocks=None: the chain is found by running the step first, which the two backward calls stop
        ("forwards", None, r"^training_step calls manual_backward 2 times per step \(several forward/backward passes"),
        ("backwards", None, r"^training_step calls manual_backward 2 times per step \(several forward/backward passes"),
    ],
)
def test_several_passes_refused_before_any_step_with_state_as_before_fit(budget, passes, blocks, match):
    data = SeededTokenData(batch_size=8)
    pl.seed_everything(0, verbose=False)
    model = with_optimizer_state(LitTwoPasses(passes=passes), data.ds[:8])
    before = training_state(model)
    # Lightning sets gradients to None at fit start: they are put back, so the step sees them as before fit
    state = FirstBatchState(grads={n: p.grad for n, p in model.named_parameters()})
    with pytest.raises(ValueError, match=match) as err:
        _fit(model, [state, _callback(budget, blocks)], data=data)
    assert "blocks=[...]" in str(err.value) and "checkpoint by hand" in str(err.value)
    assert model.losses == []  # refused at the first batch: no step ran
    assert_same_state(before, training_state(model))
    assert state.at_exception["progress"] == state.at_start["progress"]
    assert state.at_start["progress"]["global_step"] == 0


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
