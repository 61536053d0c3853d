"""Plan quality on the examples and on a model we did not write: every policy at several budgets, measured side by side.

    OMP_NUM_THREADS=1 python benchmarks/plans.py                      # full run, tens of minutes
    OMP_NUM_THREADS=1 python benchmarks/plans.py --quick              # smaller models, a few minutes
    OMP_NUM_THREADS=1 python benchmarks/plans.py --only bert --policies op-vs-block --repeats 6

For the 48-block text encoder (examples/train_encoder.py, batch 16, its config's
chain `blocks`), the ResNet-style CNN (examples/train_cnn.py, batch 64, chain
stem + layer1..4) and HF BERT with 48 layers built from its config (hidden 64, 2
heads, dropout 0.1, batch 16 x 128 tokens, chain `bert.encoder.layer`; transformers'
default attention, SDPA): profile one step (and measure on the blocks what keeping op
outputs saves and what recomputing costs: `lightning_ckpt.apply.keep_calibration`), then at
budgets 25 %, 50 % and 75 % of the way from the `full` peak to the `none` peak (for
BERT also 16 bytes per parameter plus 30 % and 60 % of the activations of `none`)
make the plan of every policy (`none`, `full`, `every_k` with the smallest k that
fits, `sqrt`, `greedy`, `optimal`, and `optimal` in `time` at block and at op
granularity) and report its predicted peak, its peak measured by the live-storage
tracker, its predicted and measured recompute FLOPs, and its training-step time as a
ratio to `none`. Batch sizes are ones where `none` runs (a CPU has no hard memory
limit, so every plan runs); a plan whose peak is over the budget is marked.
`--policies op-vs-block` makes and times only `none`, `optimal-time` and `optimal-op`.

Step times are measured interleaved in one run: each repeat visits every distinct
plan once (in a rotated order), applies it, runs one untimed warm-up step and then
timed steps, and removes it. A plan's time is the median of its timed steps. `none`
is visited several times per repeat as separate entries: the spread of their
medians (max / min) is the noise against which ratios are judged.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _examples import CNN_CHAIN, cnn_example, encoder_example  # noqa: E402
from _hf_examples import bert_example  # noqa: E402
from _timing import Case, Variant, measure_variant, step, time_variants  # noqa: E402

from lightning_ckpt import (  # noqa: E402
    InfeasibleBudgetError,
    make_plan,
    profile_model,
    resolve_blocks,
    static_memory,
)
from lightning_ckpt.apply.keep_calibration import calibrated_profile  # noqa: E402
from lightning_ckpt.planning.plan import Plan  # noqa: E402
from lightning_ckpt.units import format_bytes  # noqa: E402

POLICIES = ("none", "full", "every_k", "sqrt", "greedy", "optimal", "optimal-time", "optimal-op")
# "optimal-time": the optimal policy with cost_metric="time" (FLOPs, memory-bound and
# random bytes at the machine rates measured with the profile) instead of counted FLOPs.
# "optimal-op": optimal-time at granularity="op": a block checkpointed alone may keep
# some of its op outputs (matmuls, dropout masks) and recompute the rest.
OPTIMALS = ("optimal", "optimal-time", "optimal-op")
FRACTIONS = (0.25, 0.50, 0.75)
BASELINES = ("full", "every_k", "sqrt", "greedy")
OP_VS_BLOCK = ("none", "optimal-time", "optimal-op")
# BERT's extra budgets: 16 bytes per parameter (fp32 weights, gradients and two AdamW
# moments) plus this share of the activations of `none`, labelled "+30 %"
ACTIVATION_SHARES = (0.30, 0.60)


# ----------------------------------------------------------------------------- the two examples


def _classifier_loss(model):
    def loss_fn(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    return loss_fn


def encoder_case(quick: bool) -> Case:
    model, batch, batch_size = encoder_example(quick)
    # lr small enough that hundreds of timing steps on one batch keep the weights sane
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    _, names, blocks = resolve_blocks(model, "blocks")
    n = len(blocks)
    return Case(f"encoder ({n} blocks, batch {batch_size})", model, names, blocks, batch, _classifier_loss(model), opt, batch_size)


def cnn_case(quick: bool) -> Case:
    model, batch, batch_size = cnn_example(quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    _, names, blocks = resolve_blocks(model, CNN_CHAIN)
    return Case(f"cnn (stem + 8 blocks, batch {batch_size})", model, names, blocks, batch, _classifier_loss(model), opt, batch_size)


def hf_case(example) -> Case:
    """A `Case` of one of `_hf_examples`' models (AdamW as the examples)."""
    model, batch, batch_size, chain, loss_fn, name = example
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    _, names, blocks = resolve_blocks(model, chain)
    return Case(name, model, names, blocks, batch, loss_fn, opt, batch_size)


def bert_case(quick: bool) -> Case:
    case = hf_case(bert_example(quick))
    case.activation_budgets = True
    return case


# ----------------------------------------------------------------------------- plans and measurements


def profile_case(case: Case):
    """The profile (and the calibration on the blocks) at the case's batch, as `StepCost`."""
    step(case)  # gradients and AdamW state exist, as in steady-state training
    # calibrated after the rates are measured, so the fit of the recompute lands in them
    profile = profile_model(
        case.model, case.blocks, case.loss_fn, case.batch, (1, 2), 4, names=case.names, calibrate_keeps=False
    )
    profile = calibrated_profile(profile, case.model, case.blocks, case.loss_fn, case.batch)
    static = static_memory(case.model, [case.optimizer])
    return profile.at(
        case.batch_size, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes
    )


def case_budgets(case: Case, cost) -> dict[str, int]:
    """Budget label -> bytes: 25/50/75 % of the way from `full` to `none`, and for BERT the
    activation shares over 16 bytes per parameter."""
    none = make_plan(cost, "none").predicted_peak_bytes
    full = make_plan(cost, "full").predicted_peak_bytes
    budgets = {f"{int(100 * f)} %": int(full + f * (none - full)) for f in FRACTIONS}
    if case.activation_budgets:
        params = sum(p.numel() for p in case.model.parameters())
        activations = none - cost.static_bytes
        for share in ACTIVATION_SHARES:
            budgets[f"16 B/param +{int(100 * share)} %"] = int(16 * params + share * activations)
    return budgets


def plan_case(case: Case, policies=POLICIES) -> tuple[dict[str, int], dict[tuple[str, str], Plan | None], Any]:
    """Profile once, then every policy's plan at every budget (None: no plan fits)."""
    cost = profile_case(case)
    budgets = case_budgets(case, cost)
    plans: dict[tuple[str, str], Plan | None] = {}
    for f, budget in budgets.items():
        for policy in policies:
            try:
                if policy == "optimal-time":
                    plans[(f, policy)] = make_plan(cost, "optimal", budget, metric="time")
                elif policy == "optimal-op":
                    plans[(f, policy)] = make_plan(cost, "optimal", budget, metric="time", granularity="op")
                else:
                    plans[(f, policy)] = make_plan(cost, policy, budget)
            except InfeasibleBudgetError:
                plans[(f, policy)] = None
    return budgets, plans, cost


# ----------------------------------------------------------------------------- report


def _describe(plan: Plan, names: list[str]) -> str:
    if not plan.segments:
        return "-"
    if plan.policy == "every_k":
        k = max(b - a + 1 for a, b in plan.segments)
        head = f"k={k}: "
    else:
        head = ""
    if len(names) > 12:
        sel = f", {len(plan.keeps)} selective" if plan.keeps else ""
        return f"{head}{len(plan.checkpointed)}/{len(names)} blocks in {len(plan.segments)} seg{sel}"
    segs = [names[a] if a == b else f"{names[a]}..{names[b]}" for a, b in plan.segments]
    if plan.keeps:
        head += f"{len(plan.keeps)} selective: "
    return head + ", ".join(segs)


def _gflop(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _round_medians(v: Variant, repeats: int) -> list[float]:
    """The median of each round's timed steps of `v` (`time_variants` appends a round at a time)."""
    k = len(v.times) // repeats
    return [statistics.median(v.times[r * k:(r + 1) * k]) for r in range(repeats)]


def forward_share(case: Case, steps: int, clock: str) -> float:
    """Median time of forward + loss over median time of the whole step, without checkpointing.

    The cost of recomputing every block once is about this share of a step: on a CPU
    with dropout and other memory-bound ops it is well above the 1/3 that FLOPs suggest.
    """
    now = time.process_time if clock == "cpu" else time.perf_counter
    fwd, step = [], []
    for _ in range(steps):
        t0 = now()
        loss = case.loss_fn(case.batch)
        t1 = now()
        case.optimizer.zero_grad()
        loss.backward()
        case.optimizer.step()
        t2 = now()
        fwd.append(t1 - t0)
        step.append(t2 - t0)
    return statistics.median(fwd) / statistics.median(step)


def dropout_control(case: Case, repeats: int, steps: int, clock: str) -> float:
    """`full` over `none` with every dropout of the model set to p = 0, timed
    interleaved like the plans: how much of full's overhead is the dropout masks
    that the recompute must draw again (on a CPU, `bernoulli_` is a serial RNG)."""
    drops = [m for m in case.model.modules() if isinstance(m, torch.nn.Dropout)]
    saved_p = [m.p for m in drops]
    for m in drops:
        m.p = 0.0
    try:
        none, full = Variant("none", ()), Variant("full", tuple((i, i) for i in range(len(case.blocks))))
        time_variants(case, [none, full], repeats, steps, clock)
    finally:
        for m, p in zip(drops, saved_p):
            m.p = p
    return full.median_s / none.median_s


def run_case(
    case: Case, repeats: int, steps: int, none_copies: int, clock: str, policies=POLICIES
) -> tuple[list[str], list[str], dict]:
    t0 = time.time()
    budgets, plans, cost = plan_case(case, policies)
    # distinct plans, labelled by the first policy that produced them
    variants: dict[tuple, Variant] = {}
    for (f, policy), plan in plans.items():
        if plan is not None and (plan.segments, plan.keeps, plan.inner_segments) not in variants:
            variants[(plan.segments, plan.keeps, plan.inner_segments)] = Variant(
                policy, plan.segments, plan.keeps, inner=plan.inner_segments
            )
    nones = [Variant(f"none#{i + 1}", ()) for i in range(none_copies - 1)]
    for v in variants.values():
        measure_variant(case, v)
    t_measure = time.time() - t0
    time_variants(case, list(variants.values()) + nones, repeats, steps, clock)
    share = forward_share(case, max(3, repeats), clock) if "full" in policies else None
    t_total = time.time() - t0

    none = variants[((), (), ())]
    none_times = none.times + [t for v in nones for t in v.times]
    none_median = statistics.median(none_times)
    none_medians = [none.median_s] + [v.median_s for v in nones]
    spread = max(none_medians) / min(none_medians)
    other = [statistics.median(v.other_times) for v in [none, *nones]]
    other_spread = max(other) / min(other)
    base_flops = none.step_flops

    rows = []
    ratios: dict[tuple[str, str], tuple[float, bool, Variant]] = {}
    for f, budget in budgets.items():
        for policy in policies:
            plan = plans[(f, policy)]
            label = f"{f} ({format_bytes(budget)})"
            if plan is None:
                rows.append(f"| {case.name} | {label} | {policy} | no plan fits | NO | | | | | | | |")
                continue
            v = variants[(plan.segments, plan.keeps, plan.inner_segments)]
            err = (plan.predicted_peak_bytes - v.measured_peak) / v.measured_peak
            if plan.predicted_peak_bytes > budget:
                fits = "NO"
            elif v.measured_peak > budget:
                fits = "pred. only"
            else:
                fits = "yes"
            ratio = statistics.median(v.times) / none_median if v is not none else statistics.median(none_times) / none_median
            ratios[(f, policy)] = (ratio, fits == "yes", v)
            rows.append(
                f"| {case.name} | {label} | {policy} | {_describe(plan, case.names)} | {fits} | "
                f"{format_bytes(plan.predicted_peak_bytes)} | {format_bytes(v.measured_peak)} | {100 * err:+.1f} % | "
                f"{_gflop(plan.recompute_flops)} | {_gflop(v.step_flops - base_flops)} | "
                f"{1e3 * statistics.median(v.times if v is not none else none_times):.0f} | {ratio:.2f} |"
            )

    rates = cost.rates
    timed = [b for b in cost.blocks if b.keep_saved_ms is not None]
    notes = [
        f"{case.name}: {len(variants)} distinct plans, {repeats} rounds x {steps} timed steps each; `none` timed as "
        f"{none_copies} separate entries, medians {', '.join(f'{1e3 * m:.0f}' for m in none_medians)} ms -> "
        f"noise (max/min) {100 * (spread - 1):.1f} % ({'wall' if clock == 'cpu' else 'cpu'} clock: "
        f"{100 * (other_spread - 1):.1f} %); peaks and FLOPs took {t_measure:.0f} s, all {t_total:.0f} s.",
        f"  rates: {rates}; keeping costs {1e6 * rates.keep_draws_op_s:.1f} / {1e6 * rates.keep_ops_op_s:.1f} us per "
        f"op call (draws / other calls); {len(timed)} blocks with a measured saving beyond noise of "
        f"{sorted({round(b.keep_saved_ms, 2) for b in timed})} ms (every keepable call), "
        f"{sorted({round(b.keep_draws_saved_ms, 2) for b in timed if b.keep_draws_saved_ms is not None})} ms (draws)",
    ]
    verdicts: dict[str, Any] = {"spread": spread, "optimal_vs_baselines": {p: [] for p in OPTIMALS if p in policies}}
    for f in budgets:
        fitting = {p: ratios[(f, p)][0] for p in BASELINES if (f, p) in ratios and ratios[(f, p)][1]}
        best = min(fitting, key=fitting.get) if fitting else None
        against = f"best fitting baseline {best} x{fitting[best]:.2f}" if best else "no fitting baseline"
        for name in verdicts["optimal_vs_baselines"]:
            opt = ratios.get((f, name))
            if opt is None:
                notes.append(f"  {f}: {name} found no plan")
                verdicts["optimal_vs_baselines"][name].append(False)
                continue
            ok = opt[1] and (best is None or opt[0] <= fitting[best] * spread)
            verdicts["optimal_vs_baselines"][name].append(ok)
            notes.append(
                f"  {f}: {name} x{opt[0]:.2f} ({'fits' if opt[1] else 'DOES NOT FIT'}) vs {against} "
                f"-> {'no worse beyond noise' if ok else 'WORSE than noise allows'}"
            )
    # op-level against block-level optimal (both in `time`): never worse beyond noise, and how much better
    verdicts["op_vs_block"] = []
    for f in budgets:
        op, blk = ratios.get((f, "optimal-op")), ratios.get((f, "optimal-time"))
        if op is None or blk is None:
            notes.append(f"  {f}: optimal-op or optimal-time found no plan")
            verdicts["op_vs_block"].append((f, None, False))
            continue
        rel = op[0] / blk[0]
        # per round, the two plans' medians side by side: the spread of these ratios is the noise
        # between two plans, which the copies of `none` (one plan) can understate
        pairs = sorted(_round_medians(op[2], repeats)[k] / _round_medians(blk[2], repeats)[k] for k in range(repeats))
        lo, hi = (statistics.quantiles(pairs, n=4)[::2] if len(pairs) >= 2 else (pairs[0], pairs[0]))
        noise = max(spread - 1, (hi - lo) / 2)
        ok = op[1] and statistics.median(pairs) <= 1 + noise
        verdicts["op_vs_block"].append((f, rel, ok))
        same = " (the same plan)" if op[2] is blk[2] else f" ({len(op[2].keeps)} blocks keep op outputs)"
        notes.append(
            f"  {f}: optimal-op x{op[0]:.2f} vs optimal-time x{blk[0]:.2f}{same}: step time x{rel:.3f} "
            f"({100 * (1 - rel):+.1f} % lower; per round x{statistics.median(pairs):.3f}, quartiles "
            f"{lo:.3f}..{hi:.3f}, noise {100 * noise:.1f} %) -> "
            f"{'no worse beyond noise' if ok else 'WORSE than noise allows'}"
        )
    if "full" in policies:
        full_plan = plans[(next(iter(budgets)), "full")]
        full_v = variants[(full_plan.segments, (), ())]
        verdicts["full_ratio"] = full_v.median_s / none_median
        # what one extra forward of the recomputed blocks costs if it runs as fast as the first one
        recompute_of_forward = full_plan.recompute_flops / (full_plan.step_flops / 3)
        notes.append(
            f"  full: x{verdicts['full_ratio']:.2f} of none. The forward is {100 * share:.0f} % of a step's time here "
            f"(not the 33 % of its FLOPs) and full recomputes {100 * recompute_of_forward:.0f} % of the forward's "
            f"FLOPs: one extra forward would be x{1 + share * recompute_of_forward:.2f}."
        )
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in case.model.modules()):
            verdicts["full_ratio_no_dropout"] = dropout_control(case, max(3, repeats), steps, clock)
            notes.append(
                f"  control, same model with dropout p = 0: full x{verdicts['full_ratio_no_dropout']:.2f} of none "
                "(the rest of full's overhead is redrawing the dropout masks in the recompute)."
            )
    return rows, notes, verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer repeats: a smoke run under 2 minutes")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds (default: encoder 5, cnn 12, bert 3; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per visit (default: encoder 2, cnn 3, bert 2; quick 1)")
    parser.add_argument("--none-copies", type=int, default=3, help="how many separate `none` entries to time (noise)")
    parser.add_argument("--only", choices=("encoder", "cnn", "bert"), default=None, help="run one model only")
    parser.add_argument(
        "--policies", choices=("all", "op-vs-block"), default="all",
        help="every policy (default), or only none, optimal-time and optimal-op (more rounds in the same time)",
    )
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu",
        help="time steps by process CPU time (default: robust to other processes on the cores) or wall clock",
    )
    args = parser.parse_args(argv)
    # The encoder's step takes ~10x the CNN's: fewer rounds for it keep the run to minutes.
    default_rounds = {"encoder": (5, 2), "cnn": (12, 3), "bert": (3, 2)}
    policies = POLICIES if args.policies == "all" else OP_VS_BLOCK

    if "OMP_NUM_THREADS" not in os.environ:
        print("note: OMP_NUM_THREADS is not set; using torch.set_num_threads(1)", file=sys.stderr)
    torch.set_num_threads(1)
    print(
        f"lightning-ckpt plan benchmark: torch {torch.__version__}, {torch.get_num_threads()} thread(s) "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), {platform.machine()} CPU, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start, fp32, AdamW, "
        f"{'quick' if args.quick else 'full'} run; step times on the {args.clock} clock"
    )
    builders = {"encoder": encoder_case, "cnn": cnn_case, "bert": bert_case}
    names = [args.only] if args.only else list(builders)
    all_rows, all_notes, verdicts = [], [], {}
    for name in names:
        case = builders[name](args.quick)
        repeats = args.repeats or (2 if args.quick else default_rounds[name][0])
        steps = args.steps or (1 if args.quick else default_rounds[name][1])
        rows, notes, v = run_case(case, repeats, steps, args.none_copies, args.clock, policies)
        all_rows += rows
        all_notes += notes
        verdicts[name] = v

    print()
    print(
        "| model | budget | policy | checkpointed | fits | predicted peak | measured peak | error | "
        "recompute GFLOP (pred.) | recompute GFLOP (meas.) | step ms | x none |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(all_rows))
    print()
    print("\n".join(all_notes))
    print()
    for name, v in verdicts.items():
        for policy, oks in v["optimal_vs_baselines"].items():
            print(
                f"{name}, {policy}: fits and is no worse than any fitting baseline beyond noise "
                f"at every budget: {'yes' if all(oks) else 'NO'}"
            )
    for name, v in verdicts.items():
        rels = [rel for _, rel, _ in v["op_vs_block"] if rel is not None]
        best = f"; best {100 * (1 - min(rels)):.1f} % lower" if rels else ""
        print(
            f"{name}, optimal-op vs optimal-time: fits and no worse beyond noise at every budget: "
            f"{'yes' if all(ok for _, _, ok in v['op_vs_block']) else 'NO'}{best}"
        )
    if "encoder" in verdicts and "full_ratio" in verdicts["encoder"]:
        r, spread = verdicts["encoder"]["full_ratio"], verdicts["encoder"]["spread"]
        print(f"encoder: full step time x{r:.3f} of none (noise {100 * (spread - 1):.1f} %)")
        if "full_ratio_no_dropout" in verdicts["encoder"]:
            print(f"  with dropout off: full x{verdicts['encoder']['full_ratio_no_dropout']:.3f} of none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
