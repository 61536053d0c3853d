"""What profiling leaves behind, and its first batch's peak, each against the bound it must meet, measured
apart from the library's accounting (`tests/profile_window.py`: weak references to every storage an op
makes, in a window open from before the fit's first hook to its end; glibc's count of heap bytes in use):

A. HF Llama from config (8 layers, hidden 128, 4 heads, attention dropout 0.1) at batch (1, L) for L in
   512 and 2,048, fp32 and `bf16-mixed`, blocks named (`model.layers`) and `blocks=None`, a budget 0.2 of
   the way from the measured step with every layer checkpointed to the unplanned one (tight: the first
   sample is profiled under checkpointing):
   - `fit`: the callback's fit of 3 steps; what is alive at each step's start and at the fit's end is the
     state (parameters, buffers, gradients, optimizer state, the batch) within 1 %;
   - `heap`: `auto_checkpoint` (bf16: its step under CPU bf16 autocast); glibc's heap in use after the
     call (`malloc_trim(0)` first) within 1 MiB of before it. A first call on a twin model fills the kept
     timings (LIGHTNING_CKPT_CACHE_DIR, a new folder) and torch's own per-shape caches: its growth is
     printed beside, not bounded (under bf16 autocast torch keeps about 8.5 MiB of heap per new sequence
     length on this CPU, with or without the library).
B. The same Llama with peft's LoRA (r 8 on q_proj, v_proj), `bf16-mixed`, `blocks=None`, the callback at
   `target_batch_size=1` and 2,048 tokens, the budget half way between the measured `full` step and the
   unplanned one: the first batch, its profiling included, within 1.05x the budget.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_leftovers.py [--lengths 512 2048] [--cases A B] [--quick]

One process, the cases one after the other: about 40 minutes on a loaded 2-core machine, the
512-token cases about 4 (docs/benchmarks.md has one run's numbers).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples"), str(ROOT)]
os.environ["LIGHTNING_CKPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="lightning-ckpt-rates-")  # filled by the first call

import torch
from malloc_oracle import settled_heap_bytes
from profile_window import budget_between, causal_batch, llama, step_fn, watched_fit

from lightning_ckpt import ActivationCheckpointing, auto_checkpoint

MiB = 2**20
LAYERS, HIDDEN = 8, 128
ALIVE_WITHIN = 0.01  # alive at a step's start against the state
HEAP_WITHIN = MiB  # the heap after auto_checkpoint against before
FIRST_BATCH_WITHIN = 1.05  # the first batch's peak against the budget
failed: list[str] = []


def verdict(ok: bool, name: str) -> str:
    if not ok:
        failed.append(name)
    return "PASS" if ok else "FAIL"


def heap_case(name: str, length: int, bf16: bool, blocks: str | None, budget: int) -> None:
    """The heap around a second `auto_checkpoint` call, a first on a twin model before it."""
    batch = causal_batch(length)
    grown = []
    for _ in range(2):
        model = llama(LAYERS, HIDDEN)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = settled_heap_bytes()
        start = time.perf_counter()
        handle = auto_checkpoint(model, budget, example_batch=batch, step_fn=step_fn(model, bf16), optimizer=opt,
                                 blocks=blocks, verbose=False, info=lambda line: None)
        took = time.perf_counter() - start
        grown.append(settled_heap_bytes() - before)
        plan = handle.plan
        handle.remove()
        del model, opt, handle
    ok = abs(grown[1]) <= HEAP_WITHIN
    print(f"heap {name} | auto_checkpoint {took:5.1f} s, plan {len(plan.checkpointed)}/{plan.n_blocks} checkpointed | "
          f"heap after - before {grown[1] / MiB:+7.3f} MiB (first call {grown[0] / MiB:+7.2f} MiB) | "
          f"bound {HEAP_WITHIN / MiB:.0f} MiB | {verdict(ok, 'heap ' + name)}", flush=True)


def fit_case(name: str, length: int, precision: str, blocks: str | None, budget: int) -> None:
    """What is alive at each step's start of the callback's fit, against the state."""
    callback = ActivationCheckpointing(1, memory_budget=budget, blocks=blocks, verbose=False, report=False)
    start = time.perf_counter()
    readings, first_peak = watched_fit(llama(LAYERS, HIDDEN), length, callback, precision)
    took = time.perf_counter() - start
    ratios = [r.ratio for r in readings]
    ok = len(ratios) == 4 and all(abs(r - 1) <= ALIVE_WITHIN for r in ratios)
    worst = max(readings, key=lambda r: abs(r.ratio - 1))
    print(f"fit  {name} | fit {took:5.1f} s, plan {len(callback.plan.checkpointed)}/{callback.plan.n_blocks} | "
          f"alive / state at step starts {' '.join(f'{r:.4f}' for r in ratios[:-1])}, fit end {ratios[-1]:.4f} "
          f"(state {worst.state_bytes / MiB:.2f} MiB, alive - state {' '.join(f'{r.alive_bytes - r.state_bytes:+d}' for r in readings)} B) | "
          f"first batch {first_peak / budget:4.2f}x budget | "
          f"bound {ALIVE_WITHIN:.0%} | {verdict(ok, 'fit ' + name)}", flush=True)
    if not ok:
        print(f"     at {worst.where}: alive beside the state {worst.extra}", flush=True)


def case_a(length: int) -> None:
    for bf16 in (False, True):
        budget, full, none = budget_between(lambda: llama(LAYERS, HIDDEN), bf16, causal_batch(length), 0.2)
        precision = "bf16-mixed" if bf16 else "32-true"
        print(f"A: L={length} {precision}: budget {budget / MiB:.1f} MiB, 0.2 of the way from the full step "
              f"{full / MiB:.1f} MiB to the unplanned {none / MiB:.1f} MiB", flush=True)
        for blocks in ("model.layers", None):
            name = f"L={length:4d} {'bf16' if bf16 else 'fp32'} {'named' if blocks else 'None '}"
            heap_case(name, length, bf16, blocks, budget)
            fit_case(name, length, precision, None if blocks is None else "model.model.layers", budget)


def case_b(length: int) -> None:
    def build():
        return llama(LAYERS, HIDDEN, lora_rank=8)

    budget, full, none = budget_between(build, True, causal_batch(length), 0.5)
    callback = ActivationCheckpointing(1, memory_budget=budget, blocks=None, verbose=False, report=False)
    start = time.perf_counter()
    _, first_peak = watched_fit(build(), length, callback, "bf16-mixed", steps=2)
    took = time.perf_counter() - start
    ok = first_peak <= FIRST_BATCH_WITHIN * budget
    print(f"B: LoRA L={length} bf16-mixed blocks=None | budget {budget / MiB:.1f} MiB (full {full / MiB:.1f}, "
          f"unplanned {none / MiB:.1f}) | fit {took:5.1f} s, plan {len(callback.plan.checkpointed)}/"
          f"{callback.plan.n_blocks} of {callback.block_names[0] if callback.block_names else '?'}.. | first batch {first_peak / MiB:.1f} MiB = "
          f"{first_peak / budget:5.3f}x budget | bound {FIRST_BATCH_WITHIN}x | {verdict(ok, 'B')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--cases", nargs="+", default=["A", "B"], choices=["A", "B"])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers of hidden 64, 256 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        global LAYERS, HIDDEN
        LAYERS, HIDDEN, args.lengths = 2, 64, [256]
    warnings.simplefilter("ignore")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)", flush=True)
    if "A" in args.cases:
        for length in args.lengths:
            case_a(length)
    if "B" in args.cases:
        case_b(max(args.lengths))
    print("all PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
