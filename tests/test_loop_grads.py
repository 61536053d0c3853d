"""What a plain loop does with its gradients, read at each step's start (`frontends.loops.loop_grads`): freed
by `zero_grad()`, alive in the forward when zeroed after it (Lightning's order), kept by
`zero_grad(set_to_none=False)` or by accumulating. `auto_checkpoint` plans for what it reads, and re-plans
before the step when a loop holds more than its plans count. HF ConvNeXt and Swin from config in a plain
loop, in both `zero_grad` modes: the first steady step within the budget and between 3 % under and 1 % over
its plan's prediction, measured by a count of live storages of the test's own (`storage_oracle`)."""

from __future__ import annotations

import pytest
import torch
from storage_oracle import LiveStorages, step_state
from torch import nn

import lightning_ckpt.profiling.machine.rates as rates_module
from lightning_ckpt import auto_checkpoint
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.frontends.loops.loop_grads import LoopGradients, StepGrads

RATES = MachineRates(flop_per_s=2e10, mem_byte_per_s=5e9, rng_byte_per_s=8e8, segment_s=5e-5)


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


@pytest.mark.parametrize(
    ("order", "seen"),
    [
        ("zero_grad() at the end", [StepGrads.FREED] * 3),
        ("zero_grad() after the forward", [StepGrads.FREED, StepGrads.FORWARD, StepGrads.FORWARD]),
        ("zero_grad(set_to_none=False) at the end", [StepGrads.FREED, StepGrads.KEPT, StepGrads.KEPT]),
        ("no zero_grad", [StepGrads.FREED, StepGrads.FORWARD, StepGrads.KEPT]),
    ],
)
def test_each_loop_order_is_read_at_the_steps_starts(order, seen):
    torch.manual_seed(0)
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    grads = LoopGradients()
    got = []
    for _ in range(3):
        got.append(grads.observe(model.parameters()))
        again = grads.observe(model.parameters())  # read again within the step: nothing ran since
        assert again == StepGrads.FREED if got[-1] == StepGrads.FREED else again is None
        loss = model(x).square().mean()
        if order == "zero_grad() after the forward":
            model.zero_grad()
        loss.backward()
        if order == "zero_grad() at the end":
            model.zero_grad()
        elif order == "zero_grad(set_to_none=False) at the end":
            model.zero_grad(set_to_none=False)
    assert got == seen and grads.state == max(seen)


def test_the_most_alive_seen_holds_through_accumulation_windows():
    """Accumulating two micro-batches into fresh gradients: freed, then alive, then kept; kept holds."""
    torch.manual_seed(0)
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    grads = LoopGradients()
    for k in range(6):
        grads.observe(model.parameters())
        _step(model, x)
        if k % 3 == 2:
            model.zero_grad()
    assert grads.state == StepGrads.KEPT


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


@pytest.fixture
def fixed_rates(monkeypatch):
    """The machine rates every profile takes (the plans do not rest on a timing of this run)."""
    monkeypatch.setattr(rates_module, "kept_rates", lambda *args, **kwargs: RATES)


def test_a_loop_seen_keeping_its_gradients_is_planned_again_before_the_step(fixed_rates):
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(8, 16, 32)
    opt = torch.optim.AdamW(model.parameters())
    said: list[str] = []
    with auto_checkpoint(model, "1GiB", example_batch=x, step_fn=lambda b: model(b).square().mean(), optimizer=opt,
                         blocks="blocks", policy="full", verbose=False, info=said.append) as handle:
        first = handle.plan
        assert not handle.engine.cost.grads_live_in_forward and not handle.engine.cost.grads_accumulate
        for _ in range(3):
            handle.step(x)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        assert handle.engine.cost.grads_accumulate and handle.plan is not first
        assert handle.plan.predicted_peak_bytes > first.predicted_peak_bytes
    kept = [m for m in said if "keeps its gradients between steps" in m]
    assert len(kept) == 1 and "planned again" in kept[0]


# ----------------------------------------------------------------------------- HF models from config

SIZE = 224  # pixels
SHARE = 0.53  # of the unplanned step's peak


def _convnext():
    import transformers

    config = transformers.ConvNextConfig(hidden_sizes=[48, 96, 192, 384], depths=[2, 2, 6, 2], num_labels=10)
    return transformers.ConvNextForImageClassification(config), 12


def _swin():
    import transformers

    config = transformers.SwinConfig(image_size=SIZE, embed_dim=48, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                                     num_labels=10)
    return transformers.SwinForImageClassification(config), 8


def _built(make):
    torch.manual_seed(0)
    model, batch = make()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, 3, SIZE, SIZE, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(2)]
    return model.train(), data


def _loss(model):
    return lambda b: nn.functional.cross_entropy(model(pixel_values=b[0]).logits, b[1])


def _steps(model, data, set_to_none: bool, handle=None) -> list[tuple[int, object]]:
    """Two training steps (`handle.step` first when given), each's peak by `LiveStorages`: (peak, plan)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss, out = _loss(model), []
    for batch in data:
        plan = None if handle is None else handle.step(batch)
        with LiveStorages() as mode:
            mode.count(step_state(model, opt) + list(batch))
            loss(batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        out.append((mode.peak, plan))
    return out


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed_in_place"])
@pytest.mark.parametrize("make", [_convnext, _swin], ids=["convnext", "swin"])
def test_hf_models_in_a_plain_loop_are_predicted_in_both_zero_grad_modes(fixed_rates, make, set_to_none):
    model, data = _built(make)
    budget = int(SHARE * _steps(model, data, set_to_none)[-1][0])  # the unplanned step, steady (AdamW's state)
    model, data = _built(make)
    said: list[str] = []
    handle = auto_checkpoint(model, budget, example_batch=data[0], step_fn=_loss(model),
                             optimizer=torch.optim.AdamW(model.parameters()), verbose=False, info=said.append)
    first = handle.plan
    try:
        (_, _), (steady, plan) = _steps(model, data, set_to_none, handle)
    finally:
        handle.remove()
    predicted = plan.predicted_peak_bytes
    assert steady <= budget and plan.fits and plan.checkpointed
    assert -0.03 * predicted <= steady - predicted <= 0.01 * predicted, (steady, predicted)
    replanned = [m for m in said if "keeps its gradients between steps" in m]
    if set_to_none:  # freed: the first plan is the steady step's
        assert plan is first and not replanned
    else:  # seen kept at the steady step's start: planned again before it ran
        assert plan is not first and len(replanned) == 1
