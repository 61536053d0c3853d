"""How well each recompute cost metric predicts a block's forward time, on both examples.

    OMP_NUM_THREADS=1 python benchmarks/cost_metric.py            # about 2 minutes here
    OMP_NUM_THREADS=1 python benchmarks/cost_metric.py --quick    # smaller models, under a minute

For the 48-block text encoder (examples/train_encoder.py, batch 16, chain tok_emb +
48 blocks + ln_f + head) and the ResNet-style CNN (examples/train_cnn.py, batch 64,
chain stem + layer1..4): profile as the callback does (probes at batch 1 and 2,
extrapolated), then per block type (blocks with the same counts) print FLOPs, bytes
written by ops without FLOPs (`mem`) and by random-number ops (`rng`), the `time`
metric's estimate and the measured forward time with their ratio, and the same ratio
for FLOPs alone at the measured matmul rate and for the `ms` metric (each block timed
once while profiling, extrapolated).

Measured time: the forward of the whole model, in training mode with autograd
recording (as a recompute runs), `--repeats` times after one warm-up; every repeat
times every block (so blocks are interleaved) by this process's CPU time between
forward hooks; a block's time is the median over repeats. Then, as a check on how
much a plan depends on the measured rates: the rates are measured `--rate-runs`
times and the `time`-optimal plan is made with each set at three budgets (25/50/75 %
of the way from the `full` to the `none` peak), and the `flops`- and `time`-optimal
plans are compared by the measured forward time of the blocks they recompute.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _examples import CNN_CHAIN, cnn_example, encoder_example  # noqa: E402

from lightning_ckpt import (  # noqa: E402
    make_plan,
    measure_rates,
    profile_model,
    resolve_blocks,
    static_memory,
)
from lightning_ckpt.planning.recompute_cost import block_recompute  # noqa: E402

FRACTIONS = (0.25, 0.50, 0.75)


def _classifier_loss(model):
    def loss_fn(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return loss_fn


def encoder_case(quick: bool):
    model, batch, batch_size = encoder_example(quick)
    chain = ["tok_emb", "blocks.*", "ln_f", "head"]
    return f"encoder ({len(model.blocks)} blocks, batch {batch_size})", model, chain, batch, batch_size


def cnn_case(quick: bool):
    model, batch, batch_size = cnn_example(quick)
    return f"cnn (stem + 8 blocks, batch {batch_size})", model, CNN_CHAIN, batch, batch_size


def measured_forward_ms(model, blocks, loss_fn, batch, repeats: int) -> list[float]:
    """Median over repeats of each block's forward CPU time (ms), autograd recording."""
    samples: list[list[float]] = [[] for _ in blocks]
    starts = [0.0] * len(blocks)
    handles = []
    for i, b in enumerate(blocks):

        def pre(module, args, i=i):
            starts[i] = time.process_time()

        def post(module, args, out, i=i):
            samples[i].append((time.process_time() - starts[i]) * 1e3)

        handles.append(b.register_forward_pre_hook(pre))
        handles.append(b.register_forward_hook(post))
    try:
        loss_fn(batch)  # warm-up
        for s in samples:
            s.clear()
        for _ in range(repeats):
            loss = loss_fn(batch)
            del loss
    finally:
        for h in handles:
            h.remove()
    return [statistics.median(s) for s in samples]


def block_types(names, blocks, cost):
    """Blocks grouped by class and counted work, in chain order: (label, indices)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (blk, b) in enumerate(zip(blocks, cost.blocks)):
        groups[(type(blk).__name__, b.fwd_flops, b.fwd_mem_bytes, b.fwd_rng_bytes)].append(i)
    out = []
    for (cls, *_), idx in groups.items():
        label = f"{cls} {names[idx[0]]}" + (f" (x{len(idx)})" if len(idx) > 1 else "")
        out.append((label, idx))
    return out


def run_case(case, repeats: int, rate_runs: int) -> None:
    title, model, chain, batch, batch_size = case
    loss_fn = _classifier_loss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    loss_fn(batch).backward()  # a real step first: gradients and AdamW state exist
    opt.step()
    opt.zero_grad()
    _, names, blocks = resolve_blocks(model, chain)
    t0 = time.perf_counter()
    profile = profile_model(model, blocks, loss_fn, batch, (1, 2), 4, names=names)
    profiling_s = time.perf_counter() - t0
    static = static_memory(model, [opt])
    cost = profile.at(batch_size, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes)
    rates = cost.rates
    measured = measured_forward_ms(model, blocks, loss_fn, batch, repeats)

    print(f"## {title}")
    print(f"profiled in {profiling_s:.1f} s; rates: {rates}")
    print(f"measured: median of {repeats} forwards (autograd recording, CPU process time) after one warm-up")
    print()
    head = (
        f"| {'block type':<32} | {'GFLOP':>7} | {'mem MiB':>8} | {'rng MiB':>8} | {'time ms':>8} | {'meas. ms':>8} "
        f"| {'time/meas':>9} | {'flops-only/meas':>15} | {'ms-metric/meas':>14} |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    tot = defaultdict(float)
    for label, idx in block_types(names, blocks, cost):
        b = cost.blocks[idx[0]]
        pred = block_recompute(b, "time", rates)
        flops_only = 1e3 * b.fwd_flops / rates.flop_per_s
        meas = statistics.fmean(measured[i] for i in idx)
        ms_metric = statistics.fmean(cost.blocks[i].fwd_ms for i in idx)
        k = len(idx)
        tot["pred"] += k * pred
        tot["flops_only"] += k * flops_only
        tot["meas"] += k * meas
        tot["ms"] += k * ms_metric
        print(
            f"| {label:<32} | {b.fwd_flops / 1e9:>7.3f} | {b.fwd_mem_bytes / 2**20:>8.2f} | {b.fwd_rng_bytes / 2**20:>8.2f} "
            f"| {pred:>8.3f} | {meas:>8.3f} | {pred / meas:>9.2f} | {flops_only / meas:>15.2f} | {ms_metric / meas:>14.2f} |"
        )
    print(
        f"| {'all blocks (sum)':<32} | {'':>7} | {'':>8} | {'':>8} | {tot['pred']:>8.1f} | {tot['meas']:>8.1f} "
        f"| {tot['pred'] / tot['meas']:>9.2f} | {tot['flops_only'] / tot['meas']:>15.2f} | {tot['ms'] / tot['meas']:>14.2f} |"
    )
    print()

    # Plans: flops vs time, and time under re-measured rates.
    none = make_plan(cost, "none").predicted_peak_bytes
    full = make_plan(cost, "full").predicted_peak_bytes
    budgets = {f: int(full + f * (none - full)) for f in FRACTIONS}
    work = cost.meta["work"]
    runs = [rates] + [measure_rates(**work) for _ in range(rate_runs - 1)]
    spread = {
        name: max(getattr(r, name) for r in runs) / min(getattr(r, name) for r in runs) - 1
        for name in ("flop_per_s", "mem_byte_per_s", "rng_byte_per_s")
    }
    print(
        f"rates re-measured {len(runs)} times: spread (max/min - 1) flop {100 * spread['flop_per_s']:.1f} %, "
        f"mem {100 * spread['mem_byte_per_s']:.1f} %, rng {100 * spread['rng_byte_per_s']:.1f} %"
    )
    for f, budget in budgets.items():
        by_metric = {m: make_plan(cost, "optimal", budget, metric=m) for m in ("flops", "time")}
        distinct = {
            make_plan(dataclasses.replace(cost, meta={**cost.meta, "rates": r.to_dict()}), "optimal", budget, metric="time").segments
            for r in runs
        }
        parts = []
        for m, plan in by_metric.items():
            chosen = plan.checkpointed
            meas = sum(measured[i] for i in chosen)
            free = [names[i] for i in chosen if cost.blocks[i].fwd_flops == 0]
            parts.append(
                f"{m}: {len(chosen)} blocks in {len(plan.segments)} segments (0-FLOP blocks among them: "
                f"{', '.join(free) or 'none'}), {plan.recompute_flops / 1e9:.2f} GFLOP, "
                f"est. {plan.recompute_est_ms:.1f} ms, measured forward of those blocks {meas:.1f} ms"
            )
        print(f"- budget {100 * f:.0f} %: " + "; ".join(parts) + f"; distinct time plans over the {len(runs)} rate sets: {len(distinct)}")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed forwards per model (default 9; quick 5)")
    parser.add_argument("--rate-runs", type=int, default=5, help="how many times the rates are measured for the plan check")
    parser.add_argument("--only", choices=("encoder", "cnn"), default=None, help="run one example only")
    args = parser.parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        print("note: OMP_NUM_THREADS is not set; using torch.set_num_threads(1)", file=sys.stderr)
        torch.set_num_threads(1)
    repeats = args.repeats or (5 if args.quick else 9)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}"
    )
    print()
    for name, make in (("encoder", encoder_case), ("cnn", cnn_case)):
        if args.only in (None, name):
            run_case(make(args.quick), repeats, args.rate_runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
