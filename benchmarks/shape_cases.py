"""New shapes at run time: a multi-scale CNN (height and width drawn apart) and lengths that keep growing.

    OMP_NUM_THREADS=1 python benchmarks/shapes.py --case new-shapes --runs 5   # both cases (about 4 min)

Each case trains with `auto_checkpoint` in a plain loop and times, step by step, `handle.step(batch)` (the
library: profiling, costing, planning, switching; the first profile inside `auto_checkpoint` included) apart
from the training step; the library's time is also split into profiling (the batches and crops profiled),
costing and planning the new shapes, and the rest (reading each batch's shape, switching plans). Every step's
peak is measured by the live-storage tracker (`measure_step_peak`, state put back) against the budget, in the
same run but outside both clocks. Each case runs `--runs` times, each run in a process of its own, as a
training run is (the machine's load moves both clocks; the share is what compares). Run one after the
other in one process, the multi-scale runs' profiling took 0.26-0.35 s in the first run and 0.37-0.56 s in
the three after it (two processes of four runs), the training 0-15 % longer: oneDNN's primitive cache
(1024 kernels) is full from their first profile on. With ONEDNN_PRIMITIVE_CACHE_CAPACITY=65536 the later
runs were not slower (0.34 s, then 0.26, 0.29, 0.28 s: their kernels cached by the first). The cases take
turns. Profiles use `probe_batch_sizes=(2, 4)`: with the default (1, 2) and `check_batch_size=4` each
profile runs a third pass, the check slice, which (2, 4) makes one of the probes.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_shape_family import MultiScaleCNN, TinyLM, _budget, _cnn_loss, _lm_loss  # noqa: E402

from lightning_ckpt import auto_checkpoint, measure_step_peak  # noqa: E402
from lightning_ckpt.units import format_bytes  # noqa: E402


def run(name: str, model_fn, blocks: str, loss_of, batches, budget: int) -> dict:
    torch.manual_seed(1)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    t0, c0 = time.perf_counter(), time.process_time()
    handle = auto_checkpoint(model, budget, example_batch=batches[0], step_fn=lambda b: loss_of(model, b), optimizer=opt,
                             blocks=blocks, probe_batch_sizes=(2, 4), verbose=False)
    lib, train, peaks, per100 = time.perf_counter() - t0, 0.0, [], Counter()
    lib_cpu, train_cpu = time.process_time() - c0, 0.0  # the process's CPU time: what the machine's other jobs move less
    runs = handle.engine._shapes.profile_runs
    for i, batch in enumerate(batches):
        t0, c0 = time.perf_counter(), time.process_time()
        handle.step(batch)
        t1, c1 = time.perf_counter(), time.process_time()
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        train, train_cpu = train + time.perf_counter() - t1, train_cpu + time.process_time() - c1
        lib, lib_cpu = lib + t1 - t0, lib_cpu + c1 - c0
        plans = handle.engine._shapes
        per100[i // 100] += plans.profile_runs - runs
        runs = plans.profile_runs
        peaks.append(measure_step_peak(model, lambda b: loss_of(model, b), batch, opt))
    handle.remove()
    plans = handle.engine._shapes
    sources = Counter(d.source.split(" ")[0] for d in plans.plans.values())
    errors = [float(s.split("checked within ")[1].split(" %")[0]) for s in (d.source for d in plans.plans.values())
              if "checked within" in s]
    return {
        "case": name, "steps": len(batches), "shapes": len({tuple(tuple(t.shape) for t in b) for b in batches}),
        "lib": lib, "train": train, "cpu_share": 100 * lib_cpu / (lib_cpu + train_cpu), "profiles": plans.profile_runs, "per100": [per100[k] for k in range(len(batches) // 100 + 1)],
        "sources": sources, "err": max(errors, default=0.0), "over": sum(p > budget for p in peaks),
        "worst": max(peaks) / budget, "budget": budget, "cached": len(plans.plans),
        "profile_s": plans.profile_s, "plan_s": plans.plan_s,
    }


def multiscale(steps: int = 300, c: int = 16) -> dict:
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    sizes = list(range(16, 105, 8))  # 12 x 12 = 144 shapes
    batches = [(torch.randn(8, 3, rng.choice(sizes), rng.choice(sizes), generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(steps)]
    model_fn = lambda: MultiScaleCNN(c)  # noqa: E731
    budget = _budget(model_fn, "stages", _cnn_loss, (torch.randn(8, 3, 104, 104), torch.zeros(8, dtype=torch.long)))
    return run(f"multi-scale CNN (c={c}, batch 8, H, W apart in 16..104)", model_fn, "stages", _cnn_loss, batches, budget)


def growing(steps: int = 400, longest: int = 512) -> dict:
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    batches = []
    for i in range(steps):  # each batch padded to a multiple of 8 up to a limit that grows with the step
        top = 16 + (longest - 16) * (i + 1) // steps
        n = 8 * ((rng.randint(8, top) + 7) // 8)
        ids = torch.randint(0, 40, (4, n), generator=g)
        batches.append((ids, ids.roll(1, dims=1)))
    g2 = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (4, longest), generator=g2)
    budget = _budget(lambda: TinyLM(d=32), "layers", _lm_loss, (ids, ids))
    return run(f"growing lengths (LM d=32, batch 4, 16..{longest})", lambda: TinyLM(d=32), "layers", _lm_loss, batches, budget)


CASES = {"multiscale": multiscale, "growing": growing}


def run_apart(case: str) -> dict:
    """One run of `case` in a fresh process (`--one`): its row."""
    done = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the {case} run failed:\n{done.stderr[-4000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["sources"] = Counter(row["sources"])
    return row


def main(runs: int = 3) -> None:
    done = [(k, run_apart(case)) for _ in range(runs) for k, case in enumerate(CASES)]  # the cases in turn
    rows = [row for _, row in sorted(done, key=lambda kr: kr[0])]
    print()
    print("| case | steps | distinct shapes | library s (profiling / costing and planning / rest) | training s | library share | library share of CPU time | "
          "profiles | profiles per 100 steps | profiled / fitted / extrapolated / bounded | worst checked error | steps over budget | "
          "worst peak / budget | plans cached |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["sources"]
        rest = r["lib"] - r["profile_s"] - r["plan_s"]
        print(f"| {r['case']} | {r['steps']} | {r['shapes']} | {r['lib']:.2f} ({r['profile_s']:.2f} / {r['plan_s']:.2f} / "
              f"{rest:.2f}) | {r['train']:.2f} | "
              f"{100 * r['lib'] / (r['lib'] + r['train']):.1f} % | {r['cpu_share']:.1f} % | {r['profiles']} | {', '.join(map(str, r['per100']))} | "
              f"{s['profiled']} / {s['fitted']} / {s['extrapolated']} / {s['bounded']} | {r['err']:.2f} % | "
              f"{r['over']}/{r['steps']} | {r['worst']:.3f} of {format_bytes(r['budget'])} | {r['cached']} |")
    print()
    for name in dict.fromkeys(r["case"] for r in rows):  # the share moves with the machine's load: every run's, together
        mine = [r for r in rows if r["case"] == name]
        shares = sorted(100 * r["lib"] / (r["lib"] + r["train"]) for r in mine)
        pooled = 100 * sum(r["lib"] for r in mine) / sum(r["lib"] + r["train"] for r in mine)
        print(f"{name}: library share over {len(mine)} runs: median {statistics.median(shares):.1f} %, "
              f"range {shares[0]:.1f}-{shares[-1]:.1f} %, all runs' time together {pooled:.1f} %; of CPU time: median "
              f"{statistics.median(r['cpu_share'] for r in mine):.1f} %")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        torch.set_num_threads(1)
        print(json.dumps(CASES[sys.argv[2]]()))
    else:
        main()
