"""Shared test fixtures: one thread (see FIELD-NOTES), small models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `examples.train_encoder`, as the configs name it
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # `plan_snapshot.plans_of`

# Timings are measured afresh in every test (and in the processes tests start): a test that
# wants the kept timings of `profiling.measured_cache` points this at its own `tmp_path`.
os.environ["LIGHTNING_CKPT_CACHE_DIR"] = "off"
