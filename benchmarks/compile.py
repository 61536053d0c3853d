"""The callback with `trainer.fit(torch.compile(module))`: step time and process memory.

    OMP_NUM_THREADS=1 python benchmarks/compile.py            # about 4 min here (15 fresh processes)
    OMP_NUM_THREADS=1 python benchmarks/compile.py --quick    # smaller model, 1 round, under 2 min (noisier)

A 12-block residual MLP (d 256, hidden 1024, batch 1024, SGD) is trained for `--steps` steps,
each run in a fresh process. Per run: the median wall and process CPU time of the steps after
the first (which compiles; CPU time is the steadier of the two on a loaded machine), and the
largest RSS rise within one of those steps (kernel high-water mark, reset at the step's start,
minus the RSS then: what the step allocates on top of what persists between steps).

Step time: the callback at policy `none` against training without it, compiled with inductor and
eager, `--rounds` interleaved rounds, every run with the user's default settings (the callback's
defaults, the environment as it is): what the callback costs when it checkpoints nothing.

Memory: compiled, the callback at `none`, `full` and `optimal` (budget half way between the
predicted peaks of `none` and `full`), with glibc's mmap and trim thresholds at 64 KiB from the
environment, so that RSS follows the tensors (with glibc's defaults freed tensors stay in the
heap and the RSS rise says little). The plan's prediction is for the eager step, so the table
compares savings: predicted peak of `none` minus the policy's, against the same measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]
MIB = 2**20
# A worker process takes seconds to a few minutes; one still running after an hour hangs.
WORKER_TIMEOUT_S = 3600


def worker(policy: str | None, budget: int | None, steps: int, quick: bool, compiled: bool = True) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ckpt import ActivationCheckpointing
    from lightning_ckpt.profiling.memory.rss import RssPeak, current_rss_bytes

    torch.set_num_threads(1)
    d, hidden, n_blocks, batch = (128, 512, 8, 512) if quick else (256, 1024, 12, 1024)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
            self.head = nn.Linear(d, 1)

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return self.head(x)

        def training_step(self, b, i):
            return ((self(b[0]) - b[1]) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Meter(pl.Callback):
        def __init__(self) -> None:
            self.times, self.cpu, self.peaks, self.start = [], [], [], None
            self._rss = self._t = self._c = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = current_rss_bytes()  # parameters, last step's gradients, optimizer state
            self._rss = RssPeak().__enter__()
            self._t, self._c = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._t)
            self.cpu.append(time.process_time() - self._c)
            self._rss.__exit__(None, None, None)
            self.peaks.append(self._rss.peak_bytes - self.start)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(batch * steps, d, generator=g), torch.randn(batch * steps, 1, generator=g))
    meter = Meter()
    callbacks = [meter]  # the callback plans before the meter's batch start: the first step is left out anyway
    ckpt = None
    if policy is not None:
        ckpt = ActivationCheckpointing(
            batch, memory_budget=budget or "8GiB", policy=policy, blocks="blocks", verbose=False, report=False,
            probe_batch_sizes=(8, 16), check_batch_size=None,
        )
        callbacks.insert(0, ckpt)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir="/tmp/lckpt-compile-bench",
    )
    trainer.fit(torch.compile(Lit()) if compiled else Lit(), DataLoader(data, batch_size=batch))
    return {
        "policy": policy,
        "compiled": compiled,
        "step_s": statistics.median(meter.times[1:]),
        "step_cpu_s": statistics.median(meter.cpu[1:]),
        "rss_peak_bytes": max(meter.peaks[1:]),
        "predicted_peak_bytes": None if ckpt is None else ckpt.plan.predicted_peak_bytes,
        "checkpointed": None if ckpt is None else len(ckpt.plan.checkpointed),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _run(policy: str | None, budget: int | None, steps: int, quick: bool, compiled: bool = True, malloc: bool = False) -> dict:
    """One fresh process; `malloc`: glibc's thresholds at 64 KiB from the environment (else as it is)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if malloc:
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    args = [sys.executable, __file__, "--worker", json.dumps([policy, budget, steps, quick, compiled])]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=False, timeout=WORKER_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ratio_line(what: str, bases: list[dict], nones: list[dict], key: str) -> str:
    base_s = statistics.median(r[key] for r in bases)
    none_s = statistics.median(r[key] for r in nones)
    noise = max(r[key] for r in bases) / min(r[key] for r in bases) - 1
    ratio = none_s / base_s
    return (
        f"{what}: {ratio:.3f} ({none_s:.3f} s / {base_s:.3f} s); noise (max/min of the no-callback runs) {100 * noise:.1f} %"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved no-callback / `none` runs (default 3, quick 1)")
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))))
        return
    rounds = args.rounds or (1 if args.quick else 3)
    # no callback and `none` alternate, compiled and eager, each in a fresh process with the defaults:
    # the spread of the no-callback runs is the noise the `none` ratio is judged against
    timed: dict[tuple[bool, str | None], list[dict]] = {}
    for _ in range(rounds):
        for compiled in (True, False):
            for policy in (None, "none"):
                timed.setdefault((compiled, policy), []).append(_run(policy, None, args.steps, args.quick, compiled))
    runs = {"none": _run("none", None, args.steps, args.quick, malloc=True)}
    runs["full"] = _run("full", None, args.steps, args.quick, malloc=True)
    budget = (runs["none"]["predicted_peak_bytes"] + runs["full"]["predicted_peak_bytes"]) // 2
    runs["optimal"] = _run("optimal", budget, args.steps, args.quick, malloc=True)

    print(f"threads 1, steps {args.steps} (first left out), {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"step time, defaults (the callback's, glibc malloc as the environment has it): policy none / no callback, "
          f"median step over {rounds} interleaved run(s) each")
    for key, clock in (("step_cpu_s", "process CPU time"), ("step_s", "wall time")):
        print(f"  {clock}:")
        print("    " + _ratio_line("compiled", timed[(True, None)], timed[(True, "none")], key))
        print("    " + _ratio_line("eager   ", timed[(False, None)], timed[(False, "none")], key))
    print(f"memory, compiled, glibc mmap/trim thresholds 64 KiB from the environment; budget for optimal {budget / MIB:.1f} MiB")
    print("| run | checkpointed | graphs | graph breaks | step s | predicted peak | RSS rise in the step "
          "| predicted saving vs none | measured saving vs none | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    none = runs["none"]
    for name, r in runs.items():
        pred, meas = r["predicted_peak_bytes"], r["rss_peak_bytes"]
        psave = none["predicted_peak_bytes"] - pred
        msave = none["rss_peak_bytes"] - meas
        ratio = f"{msave / psave:.2f}" if psave else "-"
        print(
            f"| {name} | {r['checkpointed']} | {r['graphs']} | {r['graph_breaks']} | {r['step_s']:.3f} | "
            f"{pred / MIB:.1f} MiB | {meas / MIB:.1f} MiB | {psave / MIB:.1f} MiB | {msave / MIB:.1f} MiB | {ratio} |"
        )


if __name__ == "__main__":
    main()
