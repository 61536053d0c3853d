"""`python -m lightning_ckpt plan --config ...`: plan table and report, no training."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from lightning_ckpt.__main__ import main, preview

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "encoder48.yaml"


def test_plan_command_prints_table_and_writes_report_without_training(tmp_path, capsys, monkeypatch):
    import lightning_ckpt.__main__ as cli_main

    monkeypatch.chdir(ROOT)
    seen = {}

    def spy(config, overrides):
        seen["result"] = preview(config, overrides)
        return seen["result"]

    monkeypatch.setattr(cli_main, "preview", spy)
    override = [f"--trainer.logger.init_args.save_dir={tmp_path}"]
    assert main(["plan", "--config", str(CONFIG), *override]) == 0
    out = capsys.readouterr().out
    assert "lightning-ckpt plan: policy=optimal, batch_size=16" in out
    assert out.count("checkpoint ") + out.count(" keep ") >= 48
    assert "lightning_ckpt_plan.json" in out and "lightning_ckpt_tradeoff.png" in out
    cb, trainer = seen["result"]
    assert trainer.global_step == 0  # no optimizer step was taken
    assert cb.plan.fits and cb.plan.batch_size == 16
    assert all(p.exists() for p in cb.report_paths)


def test_plan_command_without_callback_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["trainer"]["callbacks"] = []
    cfg["trainer"]["logger"] = False
    path = tmp_path / "nocb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_ckpt", "plan", "--config", str(path)], capture_output=True, text=True, cwd=ROOT,
        check=False, timeout=300,
    )
    assert proc.returncode == 2
    assert "has no lightning_ckpt.ActivationCheckpointing under trainer.callbacks" in proc.stderr


def _tiny_config(tmp_path: Path, **callback) -> str:
    """The encoder config shrunk to two blocks of width 16 on 64 short sequences: seconds to plan."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["trainer"].update(logger=False, default_root_dir=str(tmp_path), val_check_interval=2, limit_val_batches=1)
    cfg["trainer"]["callbacks"][0]["init_args"].update({"target_batch_size": 4, "memory_budget": "64MiB", **callback})
    cfg["model"]["init_args"].update(n_blocks=2, d_model=16, n_heads=2, seq_len=64, vocab_size=32)
    cfg["data"]["init_args"].update(batch_size=4, seq_len=64, vocab_size=32, n_train=64, n_val=8, max_margin=4)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_budget_nothing_fits_is_one_error_line_and_exit_code_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--config", _tiny_config(tmp_path, memory_budget="2KiB")]) == 2  # returned, not raised
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert "not even batch size 1 fits: the model's state takes" in line
    assert line.endswith("Shard or offload the state (ZeRO, FSDP2, ZeRO-Offload) or raise memory_budget.")  # before any pass


def test_bad_argument_in_the_config_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--config", _tiny_config(tmp_path, memory_budget="lots")]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: memory_budget='lots' is not a size lightning-ckpt can read")


def test_wrong_blocks_prints_one_error_line_and_no_lightning_cli_warning(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_ckpt", "plan", "--config", _tiny_config(tmp_path, blocks="blocks.0")],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "LightningCLI's args parameter" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: blocks='blocks.0' names one EncoderBlock") and line.endswith("and its siblings.")


def test_errors_of_the_model_code_keep_their_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    config = _tiny_config(tmp_path)
    with pytest.raises(ValueError, match="seq_len=8 is too short"):
        main(["plan", "--config", config, "--data.init_args.seq_len=8", "--model.init_args.seq_len=8"])


def test_lightning_cli_gets_the_configs_as_its_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["python -m lightning_ckpt", "plan", "--config", _tiny_config(tmp_path, blocks="blocks.0")]
    monkeypatch.setattr(sys, "argv", argv)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(argv[1:]) == 2  # fails right after the run is built
    assert not [w for w in seen if "LightningCLI's args parameter" in str(w.message)]
    assert sys.argv == argv  # given back as it was
