"""Process memory (RSS) per training step against the budget, and what each malloc setting costs.

    OMP_NUM_THREADS=1 python benchmarks/rss.py                       # both examples, 18 min on a loaded 2-core machine
    OMP_NUM_THREADS=1 python benchmarks/rss.py --quick               # smoke run, about 2 min
    OMP_NUM_THREADS=1 python benchmarks/rss.py --settings 64K 1M 4M --models encoder

For the encoder (configs/encoder48.yaml: batch 16, 300 MiB) and the CNN (configs/cnn.yaml:
batch 64, 66 MiB), each malloc setting runs in a fresh process: the model is built, malloc is
set (glibc's mmap and trim thresholds at the given size, as `tune_allocator=True` sets them at
fit start), or left as it is ("default": glibc's defaults, what a fit gets by default), or
replaced before the process starts ("tcmalloc", "jemalloc": `LD_PRELOAD` of Debian's
libtcmalloc-minimal4 / libjemalloc2 with their defaults; skipped when not installed). The RSS
at that moment is the baseline; the step is profiled and planned (`optimal` at the budget) as
the callback does, then `--steps` AdamW steps run. Per step: the RSS peak (kernel high-water
mark, reset before each step) minus the baseline, and the process CPU time. Settings of one
model run interleaved in rounds, so load drifts hit all of them alike; "x default" is the step
time against glibc's defaults.
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
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]

MIB = 2**20
# A worker process takes seconds to a few minutes; one still running after an hour hangs.
WORKER_TIMEOUT_S = 3600
BUDGETS = {"encoder": 300 * MIB, "cnn": 66 * MIB}  # memory_budget in configs/encoder48.yaml, configs/cnn.yaml
PRELOADS = {
    "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
}


def _parse_size(text: str) -> int:
    units = {"K": 1024, "M": MIB}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def worker(model_name: str, threshold: str, steps: int, quick: bool) -> dict:
    """One process: build, set malloc, baseline, profile and plan, then measured steps."""
    import torch
    import torch.nn.functional as F
    from _examples import CNN_CHAIN, cnn_example, encoder_example

    import lightning_ckpt as lc
    from lightning_ckpt.engine.target_plan import PlanRequest, plan_for_target
    from lightning_ckpt.profiling.memory.allocator import follow_tensors_cpu
    from lightning_ckpt.profiling.memory.rss import RssPeak, current_anon_bytes, current_rss_bytes

    torch.set_num_threads(1)
    model, batch, bs = (encoder_example if model_name == "encoder" else cnn_example)(quick)
    chain = "blocks" if model_name == "encoder" else CNN_CHAIN
    _, names, blocks = lc.resolve_blocks(model, chain)
    opt = model.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    setting = None
    if threshold not in ("default", *PRELOADS):
        size = _parse_size(threshold)
        setting = follow_tensors_cpu(size, size)
        assert setting.action == "set", setting.message
    baseline, anon_baseline = current_rss_bytes(), current_anon_bytes()

    def loss_fn(b):
        return F.cross_entropy(model(b[0]), b[1])

    profile = lc.profile_model(model, blocks, loss_fn, batch, (1, 2), 4, names=names)
    static = lc.static_memory(model, [opt])
    budget = BUDGETS[model_name] if not quick else None
    if budget is None:  # quick: half way between the `full` and `none` peaks
        from lightning_ckpt.engine.target_plan import cost_at

        cost = cost_at(profile, bs, static)
        lo, hi = (lc.make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
        budget = (lo + hi) // 2
    plan, _ = plan_for_target(profile, static, PlanRequest(budget, "optimal", None, "time"), bs)
    applied = lc.apply_plan(blocks, plan)
    rss, anon, cpu = [], [], []
    for _ in range(steps):
        t0 = time.process_time()
        with RssPeak() as peak:
            loss = loss_fn(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            del loss
        cpu.append(time.process_time() - t0)
        rss.append(peak.peak_bytes - baseline)
        anon.append(peak.anon_peak_bytes - anon_baseline)
    applied.remove()
    return {
        "model": model_name, "threshold": threshold, "budget": budget, "predicted": plan.predicted_peak_bytes,
        "segments": len(plan.segments), "checkpointed": len(plan.checkpointed), "rss": rss, "anon": anon, "cpu_s": cpu,
        "method": peak.method,
    }


def _run_worker(model: str, threshold: str, steps: int, quick: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", model, threshold, "--steps", str(steps)] + (["--quick"] if quick else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if threshold in PRELOADS:
        env["LD_PRELOAD"] = PRELOADS[threshold]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, timeout=WORKER_TIMEOUT_S)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["encoder", "cnn"], choices=["encoder", "cnn"])
    ap.add_argument("--settings", nargs="+", default=["64K", "1M", "4M", "tcmalloc", "jemalloc"],
                    help="glibc thresholds (64K, 1M, ...) and preloaded allocators (tcmalloc, jemalloc)")
    ap.add_argument("--steps", type=int, default=None, help="steps per process (default 6, quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="processes per setting (default 2, quick 1)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "THRESHOLD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    steps = args.steps or (3 if args.quick else 6)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], steps, args.quick)))
        return 0

    from lightning_ckpt.profiling.memory.allocator import MMAP_THRESHOLD_BYTES

    chosen = f"{MMAP_THRESHOLD_BYTES // 1024}K"
    missing = [s for s in args.settings if s in PRELOADS and not Path(PRELOADS[s]).exists()]
    settings = ["default"] + [s for s in dict.fromkeys(args.settings) if s not in missing]
    rounds = args.rounds or (1 if args.quick else 2)
    started = time.time()
    print(f"lightning-ckpt RSS benchmark: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start, "
          f"OMP_NUM_THREADS=1, {steps} steps per process, {rounds} round(s); tune_allocator=True sets {chosen}"
          + (f"; not installed, skipped: {', '.join(missing)}" if missing else ""))
    print("RSS = peak of the step minus RSS at train start (after malloc is set); steps after the first\n")
    print("anonymous = the same without file-backed pages (library code that first calls page in)\n")
    print("| model | budget | malloc | predicted | RSS max | RSS / budget | anonymous max "
          "| anon. / budget | median step CPU s | x default |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for model in args.models:
        results: dict[str, list[dict]] = {s: [] for s in settings}
        for _ in range(rounds):
            for s in settings:
                results[s].append(_run_worker(model, s, steps, args.quick))
        base_cpu = statistics.median(c for r in results["default"] for c in r["cpu_s"][1:])
        for s in settings:
            rs = results[s]
            rss = max(x for r in rs for x in r["rss"][1:])
            anon = max(x for r in rs for x in r["anon"][1:])
            cpu = statistics.median(c for r in rs for c in r["cpu_s"][1:])
            budget = rs[0]["budget"]
            name = {"default": "glibc defaults", **{k: f"{k} (LD_PRELOAD)" for k in PRELOADS}}.get(s, f"glibc {s}")
            print(f"| {model} | {budget / MIB:.0f} MiB | {name} | {rs[0]['predicted'] / MIB:.1f} MiB | {rss / MIB:.1f} MiB "
                  f"| {rss / budget:.2f} | {anon / MIB:.1f} MiB | {anon / budget:.2f} | {cpu:.3f} | {cpu / base_cpu:.3f} |")
            verdicts.append(f"  {model}, {name}: RSS {rss / budget:.2f} x budget, step time {100 * (cpu / base_cpu - 1):+.1f} %")
    print("\n".join(["", *verdicts]))
    print(f"(RSS peak from {results['default'][0]['method']}; total wall time {time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
