"""The measured peak of one step: when it is taken, and what the CPU tracker counts."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from lightning_ckpt.integrations.measured_peak import should_measure, step_peak


def _trainer(device="cpu", optimizers=()):
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), optimizers=list(optimizers))


def test_cpu_peak_counts_the_model_state_and_what_the_step_allocates():
    model = torch.nn.Linear(256, 256)  # 256 KiB of weights
    with contextlib.ExitStack() as stack:
        reading = stack.enter_context(step_peak(_trainer(), model))
        assert reading.peak_bytes is None  # filled when the context closes
        scratch = torch.ones(128, 1024)  # 512 KiB
        del scratch
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    assert reading.peak_bytes == state + 128 * 1024 * 4


@pytest.mark.parametrize(
    ("measure_peak", "device", "has_state", "expected"),
    [
        (None, "cpu", True, False),  # on CPU only when asked for
        (True, "cpu", True, True),
        (True, "cpu", False, False),  # first step: no optimizer state yet, not the step the plan models
        (False, "cuda", True, False),
        (None, "cuda", True, True),
    ],
)
def test_measured_only_when_asked_and_steady(measure_peak, device, has_state, expected):
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param])
    if has_state:
        param.grad = torch.ones(2)
        opt.step()
    assert should_measure(_trainer(device, [opt]), measure_peak) is expected
    assert should_measure(_trainer(device, []), True) is True  # no optimizer: every step is steady
