"""The measured peak of one step: when it is taken, what the CPU tracker and RSS count, how it is reported."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from lightning_ckpt.frontends.lightning.measured_peak import fit_memory, should_measure, step_peak, summary
from lightning_ckpt.profiling.memory import allocator
from lightning_ckpt.units import format_bytes


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
        (True, "cpu", True, True),  # on by default, on CPU as on CUDA
        (False, "cpu", True, False),
        (True, "cpu", False, False),  # first step: no optimizer state yet, not the step the plan models
        (False, "cuda", True, False),
        (True, "cuda", True, True),
    ],
)
def test_measured_unless_turned_off_and_steady(measure_peak, device, has_state, expected):
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param])
    if has_state:
        param.grad = torch.ones(2)
        opt.step()
    assert should_measure(_trainer(device, [opt]), measure_peak) is expected
    assert should_measure(_trainer(device, []), True) is True  # no optimizer: every step is steady


@pytest.mark.parametrize("tune", [None, False])
def test_fit_memory_leaves_cpu_malloc_alone_by_default(tune):
    fit = fit_memory(_trainer()) if tune is None else fit_memory(_trainer(), tune)
    assert fit.allocator.action == "off" and fit.allocator.message == ""
    fit.restore()


def test_cpu_reading_has_an_rss_figure_above_the_fit_start_baseline():
    """The RSS peak above the baseline is present and sane: it covers a touched 64 MiB tensor
    that lived inside the step, and is not far above what the tracker counted."""
    from lightning_ckpt.profiling.memory.rss import current_rss_bytes

    if current_rss_bytes() is None:
        pytest.skip("needs /proc (Linux)")
    model = torch.nn.Linear(64, 64)
    fit = fit_memory(_trainer(), tune_allocator=False)
    assert fit.allocator.action == "off" and fit.rss_start_bytes > 0
    with step_peak(_trainer(), model, None, fit) as reading:
        t = torch.ones(16 * 2**20)  # 64 MiB: above glibc's largest mmap threshold, so fresh pages
        # kept alive long enough for the RSS sampler (where the kernel's high-water mark cannot be
        # reset) to run at least once, even when the other test process holds the core
        time.sleep(0.5)
        del t
    assert reading.peak_bytes >= 64 * 2**20
    assert 60 * 2**20 <= reading.rss_peak_bytes <= reading.peak_bytes + 64 * 2**20
    assert reading.reserved_peak_bytes is None
    line = summary(reading, SimpleNamespace(predicted_peak_bytes=40 * 2**20, budget_bytes=50 * 2**20))
    assert "tracked tensors" in line and "process RSS above fit start" in line and "predicted 40.0 MiB" in line


def test_the_batch_counts_in_the_measured_peak():
    model = torch.nn.Linear(4, 4)
    batch = (torch.zeros(1024, 256), torch.zeros(1024, dtype=torch.long))  # 1 MiB + 8 KiB
    with step_peak(_trainer(), model, batch) as reading:
        pass
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    assert reading.peak_bytes == state + 1024 * 256 * 4 + 1024 * 8


def test_fit_reports_tracked_and_rss_peaks_next_to_the_prediction(tmp_path, caplog):
    import json
    import logging

    from lit_models import LitChain, TokenData, make_trainer

    from lightning_ckpt import ActivationCheckpointing

    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="64MiB", policy="full", verbose=False)  # measured by default
    with caplog.at_level(logging.INFO):
        make_trainer([cb], max_steps=2, default_root_dir=str(tmp_path)).fit(LitChain(), datamodule=TokenData(batch_size=8))
    measured = json.loads((tmp_path / "lightning_ckpt_plan.json").read_text())["measured"]
    assert measured["predicted_peak_bytes"] == cb.plan.predicted_peak_bytes
    assert measured["tracked_peak_bytes"] == cb.measured_peak_bytes
    if measured["rss_peak_above_start_bytes"] is not None:  # Linux
        # A 1 MiB step can run in pages the process already holds, so its RSS growth may be 0
        # (test_cpu_reading_has_an_rss_figure_above_the_fit_start_baseline checks a growth that must show).
        rss = measured["rss_peak_above_start_bytes"]
        assert isinstance(rss, int) and abs(rss) < 2**30
        assert f"process RSS above fit start {format_bytes(rss)}" in caplog.text
    assert "first planned step at shape (batch 8, tensors [8, 16], [8]): predicted" in caplog.text
    assert "glibc malloc set for this fit" not in caplog.text  # by default CPU malloc is left alone
    assert cb._fit_memory is None  # put back at the end of fit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reading_has_max_allocated_and_max_reserved():
    model = torch.nn.Linear(64, 64).cuda()
    with step_peak(_trainer("cuda"), model) as reading:
        t = torch.ones(8 * 2**20, device="cuda")  # 32 MiB
        del t
    assert reading.peak_bytes >= 32 * 2**20 and reading.reserved_peak_bytes >= reading.peak_bytes
    assert reading.rss_peak_bytes is None


def test_a_report_that_cannot_take_the_measured_peak_is_a_warning_and_stays_whole(tmp_path, monkeypatch):
    """Adding the measured peak replaces the JSON whole: a rename refused (a full or read-only disk)
    leaves the report as it was, and a report gone or damaged is one warning; nothing raises."""
    import json
    import os

    from lightning_ckpt.frontends.lightning.measured_peak import _add_to_report

    report = tmp_path / "lightning_ckpt_plan.json"
    report.write_text(json.dumps({"plan": {}}))
    before = report.read_bytes()

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", refused)
        with pytest.warns(UserWarning, match="measured peak could not be added to the report .*PermissionError"):
            _add_to_report(report, {"tracked_peak_bytes": 1})
    assert report.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [report.name]
    _add_to_report(report, {"tracked_peak_bytes": 1})
    assert json.loads(report.read_text())["measured"] == {"tracked_peak_bytes": 1}
    report.write_text("{not json")
    with pytest.warns(UserWarning, match="JSONDecodeError"):
        _add_to_report(report, {"tracked_peak_bytes": 2})
    report.unlink()
    with pytest.warns(UserWarning, match="FileNotFoundError"):
        _add_to_report(report, {"tracked_peak_bytes": 2})
