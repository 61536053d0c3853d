"""Several CPU ranks as separate processes (gloo): ports, each rank's environment, a launch that kills every rank
when one fails or time runs out. Shared by the DeepSpeed, FSDP2, DDP and tensor-parallel jobs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# DeepSpeed JIT-builds its shared-memory op on first use (30-60 s); a fixed cache builds it once.
EXTENSIONS_DIR = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "lightning-ckpt" / "torch_extensions")
# Variables a distributed run leaves behind; the ranks must not inherit stale ones.
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
            "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, port: int, world: int = 2) -> dict[str, str]:
    """This process's environment without stale distributed variables, set for `rank` of `world` on this host."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0",
        WORLD_SIZE=str(world), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=EXTENSIONS_DIR,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]),
    )
    return env


def launch_ranks(world: int, args: list[str], out_dir: Path, timeout_s: float) -> list[dict]:
    """Run `python *args` as ranks 0..world-1 (Lightning then launches nothing itself) -> each rank's
    `out_dir/rank<r>.json`. When one rank fails the others are killed at once (they would wait for it in a
    collective); all are killed when not done in `timeout_s`, and the test fails with every rank's log tail."""
    port = free_port()
    procs = []
    for rank in range(world):
        with open(out_dir / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, env=rank_env(rank, port, world), stdout=log,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    codes = [p.wait(timeout=60) for p in procs]  # killed or done: at once
    if codes != [0] * world:
        tails = "\n".join(f"--- rank {r} ---\n{(out_dir / f'rank{r}.log').read_text()[-3000:]}" for r in range(world))
        pytest.fail(f"{world}-rank job failed or hung (return codes {codes}, timeout {timeout_s} s):\n{tails}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
