"""benchmarks/gpu_check.py: its CPU smoke run passes, and its gate fails a run over its budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def test_cpu_quick_run_passes_and_prints_every_run():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| encoder", "| cnn"))]
    assert len(rows) == 2 * 4  # none, full, optimal at two budgets, per model
    assert "0 failed" in out.stdout


def test_a_planned_run_over_its_budget_fails_the_check(monkeypatch, capsys):
    import gpu_check

    def over(name, precision, device, quick, steps, compile_too):
        return [{"model": name, "precision": precision, "run": "optimal 33 %", "budget": 10, "predicted": 9,
                 "checkpointed": "1/2", "allocated": 11, "reserved": 11, "step_s": 1.0, "error": None}]

    monkeypatch.setattr(gpu_check, "run_case", over)
    assert gpu_check.main(["--device", "cpu", "--quick"]) == 1
    assert "FAILED: encoder fp32 optimal 33 %: over its budget" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_of_one_case_reads_allocated_and_reserved():
    import gpu_check

    rows = gpu_check.run_case("cnn", "fp32", torch.device("cuda"), quick=True, steps=1, compile_too=False)
    assert all(r["error"] is None and r["reserved"] >= r["allocated"] > 0 for r in rows)


@pytest.mark.timeout(300)
def test_fsdp_offload_case_runs_its_plans():
    """The CUDA-only FSDP2 CPU-offload case, run on the CPU (where the policy moves nothing): its code
    runs, plans against the offload model and measures every plan."""
    import gpu_check

    rows = gpu_check.run_fsdp_offload(torch.device("cpu"), quick=True, steps=1)
    assert [r["run"] for r in rows] == ["full", "optimal 33 %"]
    assert all(r["error"] is None and r["allocated"] > 0 for r in rows), rows
    assert rows[1]["predicted"] <= rows[1]["budget"]
