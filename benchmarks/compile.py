"""The callback with `trainer.fit(torch.compile(module))`: step time and process memory.

    OMP_NUM_THREADS=1 python benchmarks/compile.py            # about 1 min here (4 fresh processes)
    OMP_NUM_THREADS=1 python benchmarks/compile.py --quick    # smaller model, about 40 s (noisier)

A 12-block residual MLP (d 256, hidden 1024, batch 1024, SGD) is compiled with inductor and trained
for `--steps` steps, each run in a fresh process with glibc's mmap and trim thresholds at 64 KiB
(from the environment, so every run has the same allocator). Runs: compiled without the callback,
and compiled with the callback at policy `none`, `full` and `optimal` (budget half way between the
predicted peaks of `none` and `full`). Per run: the median time of the steps after the first
(which compiles), and the largest RSS rise within one of those steps (kernel high-water mark, reset at the
step's start, minus the RSS then: what the step allocates on top of what persists between steps). The plan's prediction is for the eager step, so the
table compares savings: predicted peak of `none` minus the policy's, against the same measured.
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


def worker(policy: str | None, budget: int | None, steps: int, quick: bool) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ckpt import ActivationCheckpointing
    from lightning_ckpt.profiling.rss import RssPeak, current_rss_bytes

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
            self.times, self.peaks, self.start = [], [], None
            self._rss = self._t = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = current_rss_bytes()  # parameters, last step's gradients, optimizer state
            self._rss = RssPeak().__enter__()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._t)
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
    trainer.fit(torch.compile(Lit()), DataLoader(data, batch_size=batch))
    return {
        "policy": policy,
        "step_s": statistics.median(meter.times[1:]),
        "rss_peak_bytes": max(meter.peaks[1:]),
        "predicted_peak_bytes": None if ckpt is None else ckpt.plan.predicted_peak_bytes,
        "checkpointed": None if ckpt is None else len(ckpt.plan.checkpointed),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _run(policy: str | None, budget: int | None, steps: int, quick: bool) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    args = [sys.executable, __file__, "--worker", json.dumps([policy, budget, steps, quick])]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved no-callback / `none` runs (noise)")
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))))
        return
    # the no-callback and `none` runs alternate, each in a fresh process: the spread of the
    # no-callback runs is the noise the `none` ratio is judged against
    bases, nones = [], []
    for _ in range(args.rounds):
        bases.append(_run(None, None, args.steps, args.quick))
        nones.append(_run("none", None, args.steps, args.quick))
    runs = {"compiled, no callback": bases[0], "none": nones[0]}
    runs["full"] = _run("full", None, args.steps, args.quick)
    budget = (runs["none"]["predicted_peak_bytes"] + runs["full"]["predicted_peak_bytes"]) // 2
    runs["optimal"] = _run("optimal", budget, args.steps, args.quick)

    base_s = statistics.median(r["step_s"] for r in bases)
    none_s = statistics.median(r["step_s"] for r in nones)
    noise = max(r["step_s"] for r in bases) / min(r["step_s"] for r in bases) - 1
    ratio = none_s / base_s
    print(f"threads 1, steps {args.steps} (first left out), budget for optimal {budget / MIB:.1f} MiB")
    print(f"policy none with compile / compiled without the callback, median step time over {args.rounds} "
          f"interleaved runs each: {ratio:.3f} ({none_s:.3f} s / {base_s:.3f} s); noise (max/min of the "
          f"no-callback runs) {100 * noise:.1f} %: {'within' if abs(ratio - 1) <= noise else 'OUTSIDE'} noise")
    print("| run | checkpointed | graphs | graph breaks | step s | predicted peak | RSS rise in the step "
          "| predicted saving vs none | measured saving vs none | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    none = runs["none"]
    for name, r in runs.items():
        pred, meas = r["predicted_peak_bytes"], r["rss_peak_bytes"]
        psave = None if pred is None else none["predicted_peak_bytes"] - pred
        msave = none["rss_peak_bytes"] - meas
        ratio = f"{msave / psave:.2f}" if psave else "-"
        print(
            f"| {name} | {'-' if r['checkpointed'] is None else r['checkpointed']} | {r['graphs']} | "
            f"{r['graph_breaks']} | {r['step_s']:.3f} | {'-' if pred is None else f'{pred / MIB:.1f} MiB'} | "
            f"{meas / MIB:.1f} MiB | {'-' if psave is None else f'{psave / MIB:.1f} MiB'} | "
            f"{msave / MIB:.1f} MiB | {ratio} |"
        )


if __name__ == "__main__":
    main()
