"""Each block's backward cut where its parameter gradients are made and written (`profiling.memory.backward_phases`):
the stretches by hand on a ledger; on a real block the peaks they give equal the probe's measured backward
scratch and, into gradients that exist already, what a count of live storages of the test's own measures
(`storage_oracle`); and fitted stretch by stretch from probes of one and two samples they reach the peak
at eight, which the line through the two probes' peaks falls short of."""

from __future__ import annotations

import pytest
import torch
from storage_oracle import LiveStorages, step_state
from torch import nn

from lightning_ckpt.costs.block_costs import backward_phase_peaks
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.profiling.memory.backward_phases import backward_phases
from lightning_ckpt.profiling.memory.lifetimes import StorageLedger
from lightning_ckpt.profiling.passes.profiler import probe_step

D, TOKENS = 256, 32
WEIGHT = D * 2 * D * 4  # one weight's gradient: 512 KiB


def test_stretches_by_hand():
    """An activation gradient (100 bytes), a weight gradient made and written (50), the activation freed,
    a second weight gradient made and written (40), a last activation (10)."""
    led = StorageLedger()
    led.born("a", 100)  # tick 1
    led.born("w", 50)  # tick 2: written at once
    w = led.serial("w")
    led.freed("a")  # tick 3
    led.born("v", 40)  # tick 4: written at once
    v = led.serial("v")
    led.born("c", 10)  # tick 5
    (phases,) = backward_phases(led, [(0, 5)], [[(w, 2), (v, 4)]])
    # (peak of all but the gradients, gradients made, gradients in flight) per stretch
    assert phases == ((100, 0, 0), (100, 50, 50), (100, 50, 0), (0, 90, 40), (10, 90, 0))
    # unset: the most live (150, at tick 2); into kept gradients: each freed once written, also 150 at tick 2
    assert backward_phase_peaks(phases) == (150, 150)
    # a window that never opened has no stretches
    assert backward_phases(led, [None], [[]]) == [()]


class MLPBlock2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


@pytest.fixture(scope="module")
def chain():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, D), MLPBlock2())
    x = torch.randn(8, TOKENS, 16, generator=torch.Generator().manual_seed(1))
    return model, model[1], x, (lambda b: model(b.clone()).square().mean())


def _oracle_backward(model, block, loss_fn, x) -> int:
    """Peak live bytes from the gradient of the block's output to the end of the backward, above the bytes live
    when that gradient came, counted by `LiveStorages`; the model's `.grad` as found (unset, or kept)."""
    with LiveStorages() as mode:
        mode.count(step_state(model) + [x])
        start: list[int] = []

        def opened(grad):
            start.append(mode.bytes)
            mode.peak = mode.bytes

        def watch(module, args, out) -> None:
            out.register_hook(opened)

        handle = block.register_forward_hook(watch)
        try:
            loss_fn(x).backward()
        finally:
            handle.remove()
    return mode.peak - start[0]


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_the_stretches_give_the_measured_peaks_unset_and_into_kept_gradients(chain, batch):
    model, block, x, loss_fn = chain
    x = x[:batch]
    model.zero_grad(set_to_none=True)
    measured = probe_step(model, [block], loss_fn, x, timing=False).blocks[0]
    unset, kept = backward_phase_peaks(measured.bwd_phase_bytes)
    assert unset == measured.bwd_transient_bytes and kept == measured.kept_grads_bwd_transient_bytes
    assert _oracle_backward(model, block, loss_fn, x) == unset  # with `.grad` unset, as profiled
    assert _oracle_backward(model, block, loss_fn, x) == kept  # into the gradients the first backward left
    model.zero_grad(set_to_none=True)
    if batch == 1:  # at one sample the gradients the block writes are most of its peak: kept, they are not
        assert unset - kept >= WEIGHT // 2


def test_fitted_stretch_by_stretch_the_small_probes_reach_the_peak_at_eight(chain):
    model, block, x, loss_fn = chain
    model.zero_grad(set_to_none=True)
    at = {n: probe_step(model, [block], loss_fn, x[:n], timing=False).blocks[0] for n in (1, 2, 8)}
    fitted = profile_model(model, [block], loss_fn, x, (1, 2), None, timing=False, calibrate_keeps=False).at(8).blocks[0]
    assert fitted.bwd_transient_bytes == at[8].bwd_transient_bytes
    assert fitted.kept_grads_bwd_transient_bytes == at[8].kept_grads_bwd_transient_bytes
    assert fitted.bwd_phase_bytes == ()  # the fitted cost keeps its two peaks only
    # the line through the probes' peaks: at one and two samples the peak is where the gradients are written,
    # at eight where a weight's gradient meets the activations' (half a weight's gradient short here)
    line = at[1].bwd_transient_bytes + 7 * (at[2].bwd_transient_bytes - at[1].bwd_transient_bytes)
    assert at[8].bwd_transient_bytes - line >= WEIGHT // 4
