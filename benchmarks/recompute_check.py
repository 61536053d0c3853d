"""Estimated recompute against measured steps, and the same plan from fresh processes.

    OMP_NUM_THREADS=1 python benchmarks/recompute_check.py              # HF Llama under bf16: estimate vs measured
    OMP_NUM_THREADS=1 python benchmarks/recompute_check.py --fresh 5    # and the plans of 5 fresh processes
    OMP_NUM_THREADS=1 python benchmarks/recompute_check.py --quick      # smaller models, fewer rounds

estimate: HF Llama built from its config (`_hf_examples.llama_example`: 16 layers, hidden
128, batch 8 x 128 tokens) whose step runs under `torch.autocast("cpu", torch.bfloat16)`, as
Lightning's `bf16-mixed` does on a CPU. Profile it as `benchmarks/plans.py` does (the rates, then the
calibration on the blocks: `lightning_ckpt.apply.keep_calibration`), plan `optimal` in `time` at
25, 50 and 75 % of the way from the `full` peak to the `none` peak, and `full`; time `none`
and each plan interleaved (rounds in a rotating order, one untimed step per visit, CPU
clock) and compare each plan's estimated recompute (`Plan.recompute_est_ms`) with its
measured step time over `none` (the median over rounds of each round's difference).

fresh: the profile and the `time` plans at block and op granularity made in N fresh
processes (`--worker`), for the Llama and for HF BERT-48 (`plans.py`'s), and how many
distinct plans each budget got, with the spread of the measured rates across processes:
first with the timings kept between runs as a user's runs keep them (`profiling.machine.measured_cache`:
one new folder, so the first process measures and the others read it back), then with every
process measuring (`LIGHTNING_CKPT_CACHE_DIR=off`), which shows the noise the kept timings remove.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _hf_examples import llama_example  # noqa: E402
from _timing import Case, Variant, time_variants  # noqa: E402
from plans import bert_case, case_budgets, hf_case, profile_case  # noqa: E402

from lightning_ckpt import make_plan  # noqa: E402

# A worker process takes seconds to a few minutes; one still running after an hour hangs.
WORKER_TIMEOUT_S = 3600
WITHIN = 0.25  # an estimate within this share of the measured difference is good enough to plan with


def llama_case(quick: bool) -> Case:
    return hf_case(llama_example(quick))


BUILDERS = {"llama": llama_case, "bert": bert_case}


def estimate(quick: bool, repeats: int, steps: int) -> bool:
    case = llama_case(quick)
    cost = profile_case(case)
    print(f"{case.name}; rates: {cost.rates}")
    plans = {f: make_plan(cost, "optimal", b, metric="time") for f, b in case_budgets(case, cost).items()}
    plans["full"] = make_plan(cost, "full")
    variants = {"none": Variant("none", ())}
    for label, plan in plans.items():
        variants[label] = Variant(label, plan.segments)
    time_variants(case, list(variants.values()), repeats, steps, "cpu")
    base = variants["none"]
    per_visit = len(base.times) // repeats
    print(f"{repeats} rounds x {steps} timed steps, none {1e3 * base.median_s:.0f} ms")
    print("| plan | segments | estimated recompute ms | measured step - none ms | estimate / measured |")
    print("|---|---|---|---|---|")
    good = True
    for label, plan in plans.items():
        v = variants[label]
        # per round: this plan's median step less none's median step in the same round
        diffs = [
            statistics.median(v.times[k * per_visit:(k + 1) * per_visit])
            - statistics.median(base.times[k * per_visit:(k + 1) * per_visit])
            for k in range(repeats)
        ]
        measured = 1e3 * statistics.median(diffs)
        est = plan.recompute_est_ms
        ratio = est / measured if measured > 0 else float("inf")
        good &= abs(ratio - 1) <= WITHIN
        segs = f"{len(plan.checkpointed)} blocks in {len(plan.segments)} segments"
        print(f"| {label} | {segs} | {est:.1f} | {measured:.1f} | {ratio:.2f} |")
    print(f"every estimate within {100 * WITHIN:.0f} % of the measured difference: {'yes' if good else 'NO'}")
    return good


def worker(model: str, quick: bool) -> None:
    case = BUILDERS[model](quick)
    cost = profile_case(case)
    out = {"rates": cost.rates.to_dict(), "plans": {}}
    for label, budget in case_budgets(case, cost).items():
        for granularity in ("block", "op"):
            plan = make_plan(cost, "optimal", budget, metric="time", granularity=granularity)
            out["plans"][f"{label} {granularity}"] = [plan.segments, plan.keeps, round(plan.recompute_est_ms, 2)]
    print(json.dumps(out))


def fresh(n: int, models: list[str], quick: bool, kept: bool) -> bool:
    """`kept`: the processes share one new folder of kept timings (the first measures, the others
    read it back: a user's later runs); else every process measures (`LIGHTNING_CKPT_CACHE_DIR=off`)."""
    same = True
    mode = "timings kept (the first process measures)" if kept else "timings measured in every process"
    for model in models:
        runs = []
        t0 = time.time()
        with tempfile.TemporaryDirectory() as folder:
            env = {**os.environ, "LIGHTNING_CKPT_CACHE_DIR": folder if kept else "off"}
            env.pop("LIGHTNING_CKPT_REMEASURE", None)
            for _ in range(n):
                cmd = [sys.executable, __file__, "--worker", model] + (["--quick"] if quick else [])
                done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, timeout=WORKER_TIMEOUT_S)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{model}, {mode}: {n} fresh processes in {time.time() - t0:.0f} s")
        for name in ("flop_per_s", "mem_byte_per_s", "rng_byte_per_s", "segment_s", "op_call_s", "keep_ops_op_s"):
            values = [r["rates"][name] for r in runs]
            spread = max(values) / min(values) - 1 if min(values) > 0 else float("inf")
            print(f"  {name}: median {statistics.median(values):.4g}, spread (max/min - 1) {100 * spread:.1f} %")
        for label in runs[0]["plans"]:
            plans = [json.dumps(r["plans"][label][:2]) for r in runs]
            distinct = len(set(plans))
            same &= distinct == 1
            ests = [r["plans"][label][2] for r in runs]
            print(f"  {label}: {distinct} distinct plan(s) in {n} runs; estimated recompute "
                  f"{min(ests):.1f}..{max(ests):.1f} ms")
    print(f"the same plan in every fresh process at every budget, {mode}: {'yes' if same else 'NO'}")
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer rounds")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds (default 8; quick 3)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per visit")
    parser.add_argument("--fresh", type=int, default=0, help="also plan in this many fresh processes")
    parser.add_argument("--fresh-only", action="store_true", help="skip the estimate check")
    parser.add_argument("--models", default="llama,bert", help="models of the fresh-process check")
    parser.add_argument("--worker", choices=tuple(BUILDERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.worker:
        worker(args.worker, args.quick)
        return 0
    print(
        f"lightning-ckpt recompute check: torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"{platform.machine()} CPU, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start"
    )
    ok = True
    if not args.fresh_only:
        ok &= estimate(args.quick, args.repeats or (3 if args.quick else 8), args.steps)
    if args.fresh:
        kept = fresh(args.fresh, args.models.split(","), args.quick, kept=True)
        fresh(args.fresh, args.models.split(","), args.quick, kept=False)  # shown: what the kept timings take away
        ok &= kept
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
