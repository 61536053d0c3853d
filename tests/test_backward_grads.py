"""Gradients a Lightning module keeps through its backward (an `optimizer_zero_grad` override with
`set_to_none=False`): planned as kept from the first step, every step within the budget and the worst
predicted within 1 % by a count of live storages apart from the library's (`storage_oracle`); an override
that frees them is seen at its second backward and planned again as Lightning's default."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from test_accumulation import TOLERANCE, LitMLP, OracleMicroBatches, _features, _mlp_budget, fixed_rates  # noqa: F401
from lit_models import make_trainer

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.frontends.lightning.backward_grads import BackwardGrads, zeroes_its_own_way


class KeepsGrads(LitMLP):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


class FreesGrads(LitMLP):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad()


class Manual(LitMLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_who_zeroes_in_its_own_way():
    assert not zeroes_its_own_way(LitMLP())
    assert zeroes_its_own_way(KeepsGrads()) and zeroes_its_own_way(FreesGrads()) and zeroes_its_own_way(Manual())


def test_the_first_backward_of_a_fresh_model_says_nothing_a_later_one_does():
    p = torch.nn.Parameter(torch.ones(3))
    seen = BackwardGrads(KeepsGrads())
    assert seen.state and seen.kept is None  # assumed kept until shown
    seen.observe([p])
    assert seen.kept is None  # no gradient before the first backward, either way
    seen.observe([p])
    assert seen.kept is False and not seen.state and "freed" in seen.describe()
    p.grad = torch.zeros(3)
    seen.observe([p])
    assert seen.kept is True and "alive" in seen.describe()
    p.grad = None
    seen.observe([p])
    assert seen.kept is True  # the most alive seen holds


def _fit(module: pl.LightningModule, callbacks, max_steps: int) -> None:
    pl.seed_everything(0, verbose=False)
    make_trainer(callbacks, max_steps=max_steps).fit(module, train_dataloaders=_features(4 * 8))


@pytest.mark.timeout(300)
def test_an_override_that_keeps_gradients_is_planned_with_them_from_the_first_step(fixed_rates, caplog):
    budget = _mlp_budget()  # half way between `full` and none, gradients alive through the step
    cb = ActivationCheckpointing(8, memory_budget=budget, verbose=False, report=False)
    oracle = OracleMicroBatches(cb)
    with caplog.at_level("INFO"):
        _fit(KeepsGrads(), [cb, oracle], max_steps=4)
    plan = cb.plan
    assert plan.segments and cb.cost.grads_accumulate and all(p is plan for _, _, p in oracle.rows)
    over = [(i, peak) for i, (peak, _, _) in enumerate(oracle.rows) if peak > budget]
    assert not over, f"steps over the budget of {budget} bytes: {over}"
    worst = max(peak for peak, _, _ in oracle.rows[1:])  # gradients alive from the second step on
    assert abs(plan.predicted_peak_bytes - worst) <= TOLERANCE * worst, (plan.predicted_peak_bytes, worst)
    assert not [r for r in caplog.records if "plan(s) made" in r.getMessage()]  # kept as assumed: no re-plan


@pytest.mark.timeout(300)
def test_an_override_that_frees_gradients_is_planned_again_as_the_default(fixed_rates, caplog):
    budget = _mlp_budget()
    default = ActivationCheckpointing(8, memory_budget=budget, verbose=False, report=False)
    _fit(LitMLP(), [default], max_steps=3)
    cb = ActivationCheckpointing(8, memory_budget=budget, verbose=False, report=False)
    oracle = OracleMicroBatches(cb)
    with caplog.at_level("INFO"):
        _fit(FreesGrads(), [cb, oracle], max_steps=4)
    first, last = oracle.rows[0][2], cb.plan
    assert not cb.cost.grads_accumulate and last is not first
    assert (last.segments, last.predicted_peak_bytes) == (default.plan.segments, default.plan.predicted_peak_bytes)
    said = [r.getMessage() for r in caplog.records if "freed before each backward" in r.getMessage()]
    assert len(said) == 1 and "dropped" in said[0]
    assert all(peak <= budget for peak, _, _ in oracle.rows)
