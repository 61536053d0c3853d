"""Shared test fixtures: one thread (see FIELD-NOTES), small models, DeepSpeed's ops built afresh in a
folder of the session's own, property tests judged by their outcome only, and in CI a check at the start
that torch is the CPU build."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `examples.train_encoder`, as the configs name it
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # `plan_snapshot.plans_of`

# Timings are measured afresh in every test (and in the processes tests start): a test that
# wants the kept timings of `profiling.machine.measured_cache` points this at its own `tmp_path`.
os.environ["LIGHTNING_CKPT_CACHE_DIR"] = "off"

# DeepSpeed JIT-builds its CPU ops (here its shared-memory communication op) into TORCH_EXTENSIONS_DIR, by
# default under the home folder, where an earlier run's build would be loaded again and a build that no
# longer works would go unseen. Each session builds them in a new folder (the ranks its tests start
# inherit it; the build takes 1-2 minutes on two busy cores), set before any test module imports
# DeepSpeed and removed when the session ends.
# With `-n 2` (README) the test processes inherit the folder of the process that started them, so the ops
# are built once per session (torch's build lock makes a second process wait for the first build).
SESSION_DIR_VAR = "LIGHTNING_CKPT_TEST_EXTENSIONS_DIR"
OWNS_EXTENSIONS_DIR = SESSION_DIR_VAR not in os.environ
if OWNS_EXTENSIONS_DIR:
    os.environ[SESSION_DIR_VAR] = tempfile.mkdtemp(prefix="lightning-ckpt-torch-extensions-")
EXTENSIONS_DIR = os.environ[SESSION_DIR_VAR]
os.environ["TORCH_EXTENSIONS_DIR"] = EXTENSIONS_DIR

# A property test fails on a wrong answer, never on how long an example or its generation takes.
settings.register_profile("lightning-ckpt", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lightning-ckpt")

# `.ci/run` sets this to 1: the tests then refuse to start on any torch but the CPU build.
REQUIRE_CPU_TORCH = "LIGHTNING_CKPT_CI_REQUIRE_CPU_TORCH"


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get(REQUIRE_CPU_TORCH) != "1":
        return
    if torch.version.cuda is not None or "+cpu" not in torch.__version__:
        pytest.exit(
            f"{REQUIRE_CPU_TORCH}=1, but the installed torch is {torch.__version__} (CUDA {torch.version.cuda}), "
            "not the CPU build: something the test extras installed replaced it. Reinstall with "
            "`-c .ci/constraints.txt` and the CPU wheel (PIP_FIND_LINKS=/opt/wheels), as .ci/run does.",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    if OWNS_EXTENSIONS_DIR:
        shutil.rmtree(EXTENSIONS_DIR, ignore_errors=True)

