"""The report's files are optional output: written whole or not at all, never through a symlink, and a
file that cannot be written is one warning while training goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_capacity import cost_at

import lightning_ckpt.report.files as report
from lightning_ckpt.planning.policies import make_plan
from lightning_ckpt.report.files import REPORT_JSON, REPORT_PNG, wait_for_plots, write_report

UNWRITTEN = r"plan report could not be written to .*{name} \({error}.*training goes on"


def _plan_and_cost():
    cost = cost_at(8)
    return make_plan(cost, "full"), cost


def _report_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "lightning-ckpt" in str(w.message)]


def test_a_folder_that_cannot_be_made_is_one_warning_and_no_file(tmp_path):
    plan, cost = _plan_and_cost()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match=UNWRITTEN.format(name=REPORT_JSON, error="NotADirectoryError")) as record:
        assert write_report(blocker / "logs", plan, None, cost) == []
    assert len(_report_warnings(record)) == 1  # the PNG is not tried
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_failed_rename_keeps_the_old_report_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A folder that refuses the new file (read-only, even for root: the rename raises) keeps what was there."""
    plan, cost = _plan_and_cost()
    write_report(tmp_path, plan, None, None)
    before = (tmp_path / REPORT_JSON).read_bytes()

    def refused(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", refused)
    with pytest.warns(UserWarning, match=UNWRITTEN.format(name=REPORT_JSON, error="PermissionError")) as record:
        assert write_report(tmp_path, make_plan(cost, "none"), None, cost) == []
    assert len(_report_warnings(record)) == 1
    assert (tmp_path / REPORT_JSON).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [REPORT_JSON]


_SIZE_LIMITED = """
import json, resource, signal, sys, warnings
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_capacity import cost_at
from lightning_ckpt.planning.policies import make_plan
from lightning_ckpt.report.files import write_report
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
cost = cost_at(8)
plan = make_plan(cost, "full")
resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    paths = write_report(Path({folder!r}), plan, None, cost)
print(json.dumps({{"paths": [str(p) for p in paths], "warnings": [str(w.message) for w in record]}}))
"""


def test_a_file_size_limit_is_one_warning_and_no_partial_file(tmp_path):
    """The file size limit (what a full disk does too): the JSON write fails part way; nothing is left."""
    folder = tmp_path / "logs"
    folder.mkdir()
    script = _SIZE_LIMITED.format(tests=str(Path(__file__).parent), folder=str(folder))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["paths"] == []
    told = [w for w in out["warnings"] if "lightning-ckpt" in w]
    assert len(told) == 1 and str(folder / REPORT_JSON) in told[0] and "File too large" in told[0], told
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("background", [False, True])
def test_a_symlinked_report_is_replaced_never_written_through(tmp_path, background):
    plan, cost = _plan_and_cost()
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in (REPORT_JSON, REPORT_PNG):
        (outside / name).write_bytes(b"not yours to overwrite " + name.encode())
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in (REPORT_JSON, REPORT_PNG):
        (logs / name).symlink_to(outside / name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert write_report(logs, plan, None, cost, background=background) == [logs / REPORT_JSON, logs / REPORT_PNG]
    assert wait_for_plots() == []
    for name in (REPORT_JSON, REPORT_PNG):
        assert (outside / name).read_bytes() == b"not yours to overwrite " + name.encode()
        assert not (logs / name).is_symlink()
    assert json.loads((logs / REPORT_JSON).read_text())["plan"]["policy"] == "full"
    assert (logs / REPORT_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_that_fails_part_way_leaves_no_partial_png(tmp_path, monkeypatch):
    plan, cost = _plan_and_cost()

    def half_written(path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "plot_tradeoff", half_written)
    write_report(tmp_path, plan, None, cost, background=True)
    failed = wait_for_plots()
    assert len(failed) == 1 and "No space left on device" in failed[0] and REPORT_PNG in failed[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [REPORT_JSON]
    with pytest.warns(UserWarning, match=UNWRITTEN.format(name=REPORT_PNG, error="OSError")):
        assert write_report(tmp_path / "drawn-here", plan, None, cost) == [tmp_path / "drawn-here" / REPORT_JSON]
    assert sorted(p.name for p in (tmp_path / "drawn-here").iterdir()) == [REPORT_JSON]


def test_a_fit_whose_report_cannot_be_written_trains_on_with_one_warning(tmp_path, monkeypatch):
    import lightning.pytorch as pl
    from lit_models import LitChain, TokenData

    from lightning_ckpt import ActivationCheckpointing

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.chdir(tmp_path)
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="full", verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[cb], logger=False, default_root_dir=blocker / "logs",
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(LitChain(), datamodule=TokenData(batch_size=8))
    assert trainer.global_step == 2 and cb.report_paths == []
    told = [w for w in _report_warnings(record) if "report" in w or "plot" in w]
    assert len(told) == 1, told
    assert str(blocker / "logs" / REPORT_JSON) in told[0] and "training goes on" in told[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
