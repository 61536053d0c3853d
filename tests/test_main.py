"""`python -m lightning_ckpt plan --config ...`: plan table and report, no training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
        check=False,
    )
    assert proc.returncode == 2
    assert "has no lightning_ckpt.ActivationCheckpointing under trainer.callbacks" in proc.stderr
