"""Variable batch shapes: a plan per shape against one plan for the longest shape, measured side by side.

    OMP_NUM_THREADS=1 python benchmarks/shapes.py           # BERT, 12 layers, batch 16, 48 batches (~7 min)
    OMP_NUM_THREADS=1 python benchmarks/shapes.py --quick   # 4 small layers, batch 8, 12 batches (~40 s)
    OMP_NUM_THREADS=1 python benchmarks/shapes.py --case new-shapes   # multi-scale CNN, growing lengths

HF BERT (`BertForSequenceClassification` from config: 12 layers, hidden 64, dropout 0.1, AdamW)
trains on batches padded per batch by `DataCollatorWithPadding`, each batch at its own length (a
seeded list drawn from 32..128, the first at 32). The budget is half way between the `none` and
`full` peaks the callback predicts at the longest length. Every run is a fresh model from the same
seed on the same batches: `per-shape` (`ActivationCheckpointing`, planning each batch shape),
`longest-plan` (the callback's plan made on data of the longest length only, applied by hand with
`apply_plan` to every step, no callback) and `none` (no checkpointing; over the budget on the long
batches, which is reported, not an error). Every callback runs with `tune_allocator=False`, so all
runs use glibc's default malloc and the plans alone are compared.

A step is timed by a callback placed after `ActivationCheckpointing`, from its batch start to its
batch end: what the callback does in its own `on_train_batch_start` (profiling, planning,
switching) is outside the step and reported apart. The first `SKIP` steps are left out. Timing is
interleaved step by step: in each round the runs are fits in threads that take turns one training
step at a time (`Lockstep`; never two at once), `none` twice as separate entries. A ratio is the
median over rounds of the ratio of two runs' median steps in one round; part 1 also gives it for
the sums of the timed steps, part 2 as the median of step-by-step ratios (step i of one run over
step i of the other, run one after the other on batches of one shape). The noise is the spread of
the two `none` entries. Peaks come from a separate, untimed run of each configuration with
`StepPeaks` (the live-storage tracker over the whole step, which slows steps).

The reverse order check trains long batches first, then short ones, and times the short batches
under per-shape planning, under the short length's own plan (made at that length only, applied by
hand) and under the longest plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import random
import statistics
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from hf_models import LitHF, PaddedTextData, StepPeaks, tiny_bert  # noqa: E402
from lit_models import make_trainer  # noqa: E402

from lightning_ckpt import ActivationCheckpointing, apply_plan, make_plan, resolve_blocks  # noqa: E402
from lightning_ckpt.planning.plan import Plan  # noqa: E402
from lightning_ckpt.units import format_bytes  # noqa: E402
from lightning_ckpt.planning.shape_profile import FIT_TOLERANCE  # noqa: E402
from lightning_ckpt.engine.shape_plans import same_regions  # noqa: E402

SKIP = 3  # steps left out at the start of a run: optimizer state created, allocator warming up


@dataclasses.dataclass(frozen=True)
class Setup:
    """The model and the data of one benchmark size."""

    layers: int
    hidden: int
    batch: int
    n_batches: int
    shortest: int
    longest: int
    rounds: int
    reverse_long: int  # long batches, then `reverse_short` short ones, in the reverse order check,
    reverse_short: int  # where the first `reverse_skip` short steps are not timed, in `reverse_rounds`
    reverse_skip: int
    reverse_rounds: int
    switches: int  # plan switches timed

    def lengths(self, seed: int = 0) -> list[int]:
        """`n_batches` lengths drawn from shortest..longest, the first batch at the shortest."""
        rng = random.Random(seed)
        return [self.shortest] + [rng.randint(self.shortest, self.longest) for _ in range(self.n_batches - 1)]


FULL = Setup(layers=12, hidden=64, batch=16, n_batches=48, shortest=32, longest=128, rounds=3,
             reverse_long=4, reverse_short=26, reverse_skip=2, reverse_rounds=4, switches=200)
QUICK = Setup(layers=4, hidden=32, batch=8, n_batches=12, shortest=16, longest=64, rounds=2,
              reverse_long=3, reverse_short=6, reverse_skip=1, reverse_rounds=2, switches=50)


class StepTimes(pl.Callback):
    """Wall and process CPU time of each step, from this callback's batch start to its batch end;
    with `mark` (a callback placed first) also the time the callbacks between them took."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.before: list[float] = []  # wall seconds from `mark`'s batch start to this one's
        self._t0 = (0.0, 0.0)
        self._marked = None

    def mark(self) -> pl.Callback:
        timer = self

        class Mark(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                timer._marked = time.perf_counter()

        return Mark()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = (time.perf_counter(), time.process_time())
        if self._marked is not None:
            self.before.append(self._t0[0] - self._marked)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        w0, c0 = self._t0
        self.wall.append(time.perf_counter() - w0)
        self.cpu.append(time.process_time() - c0)


def quiet() -> None:
    """Lightning's notes and the callback's per-shape lines would drown the tables."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_ckpt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def callback(s: Setup, budget: int | str, **kw) -> ActivationCheckpointing:
    return ActivationCheckpointing(s.batch, memory_budget=budget, report=False, verbose=False, tune_allocator=False, **kw)


def fit(s: Setup, lengths: list[int], callbacks=(), plan: Plan | None = None, peaks: bool = False, first=()):
    """A fresh model from seed 0 trained one step per length, `plan` applied by hand when given,
    `first` callbacks ahead of all others; -> (step times, StepPeaks or None)."""
    pl.seed_everything(0, verbose=False)
    model = LitHF(tiny_bert(s.layers, s.hidden, 0.1))
    handle = None
    if plan is not None:
        handle = apply_plan(resolve_blocks(model, None)[2], plan)
    timer = StepTimes()
    tracker = StepPeaks() if peaks else None
    marks = [timer.mark()] if callbacks else []
    trainer = make_trainer([*first, *marks, *callbacks, timer, *([tracker] if tracker else [])], max_steps=len(lengths))
    try:
        trainer.fit(model, datamodule=PaddedTextData(lengths, s.batch, 0))
    finally:
        if handle is not None:
            handle.remove()
    return timer, tracker


def plan_at(s: Setup, length: int, budget: int) -> Plan:
    """The callback's plan at `length`, made on data of only that length."""
    cb = callback(s, budget)
    fit(s, [length], [cb])
    return cb.plan


def predicted_peaks(s: Setup, length: int) -> tuple[int, int]:
    """`none` and `full` predicted peaks at `length`, from a callback run with policy='none'."""
    probe = callback(s, "64GiB", policy="none")
    fit(s, [length], [probe])
    return make_plan(probe.cost, "none").predicted_peak_bytes, make_plan(probe.cost, "full").predicted_peak_bytes


def median_of(times: list[float], keep) -> float:
    return statistics.median(t for i, t in enumerate(times) if keep(i))


class Lockstep:
    """Fits in threads that take turns one training step at a time: the steps compared run back to
    back, so the load of other processes, which drifts over seconds, falls on all of them alike.
    Only the thread whose turn it is runs (a turn is everything from one batch start to the next);
    the others wait, so no two steps ever overlap."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._live = list(range(n))
        self._turn = 0

    def _advance(self, k: int) -> None:
        i = self._live.index(k)
        self._turn = self._live[(i + 1) % len(self._live)]
        self._cond.notify_all()

    def wait(self, k: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == k)

    def pass_on(self, k: int) -> None:
        with self._cond:
            self._advance(k)
        self.wait(k)

    def leave(self, k: int) -> None:
        with self._cond:
            if len(self._live) > 1:
                self._advance(k)
            self._live.remove(k)

    def callback(self, k: int) -> pl.Callback:
        lockstep = self

        class Turn(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                lockstep.pass_on(k)

        return Turn()


def lockstep(runs: dict) -> dict[str, StepTimes]:
    """Every `runs[name](first_callbacks)` (a `fit`) in its own thread, in turn one step at a time."""
    turns = Lockstep(len(runs))
    out: dict[str, StepTimes] = {}
    errors: list[BaseException] = []

    def worker(k: int, name: str, run) -> None:
        torch.set_num_threads(1)
        turns.wait(k)
        try:
            out[name] = run([turns.callback(k)])
        except BaseException as err:  # noqa: BLE001 - raised again in the main thread
            errors.append(err)
        finally:
            turns.leave(k)

    threads = [threading.Thread(target=worker, args=(k, name, run)) for k, (name, run) in enumerate(runs.items())]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return out


def rounds_of(runs: dict, rounds: int, keep) -> dict[str, dict[str, list]]:
    """`rounds` lockstep rounds of all runs (the order of turns rotated each round); -> {name:
    {'wall': [...], 'cpu': [...], 'timers': [...]}}, per-round medians over the steps `keep` selects."""
    out = {name: {"wall": [], "cpu": [], "timers": [], "keep": keep} for name in runs}
    names = list(runs)
    for r in range(rounds):
        k = r % len(names)
        got = lockstep({name: runs[name] for name in names[k:] + names[:k]})
        for name, timer in got.items():
            out[name]["wall"].append(median_of(timer.wall, keep))
            out[name]["cpu"].append(median_of(timer.cpu, keep))
            out[name]["timers"].append(timer)
    return out


def ratio(got: dict, ref: dict, clock: str) -> float:
    """Median over rounds of a run's median over the same round's reference median."""
    return statistics.median(a / b for a, b in zip(got[clock], ref[clock]))


def paired(got: dict, ref: dict) -> float:
    """Median over every timed step of every round of the step's time over the same step's in the
    reference run: in lockstep the two ran one after the other, on a batch of the same shape."""
    keep = got["keep"]
    return statistics.median(
        a / b
        for tg, tr in zip(got["timers"], ref["timers"])
        for i, (a, b) in enumerate(zip(tg.wall, tr.wall))
        if keep(i)
    )


def total(got: dict, ref: dict) -> float:
    """Median over rounds of the ratio of the two runs' summed timed steps in one round."""
    keep = got["keep"]
    sums = [[sum(w for i, w in enumerate(tm.wall) if keep(i)) for tm in r["timers"]] for r in (got, ref)]
    return statistics.median(a / b for a, b in zip(*sums))


def by_round(got: dict, ref: dict) -> str:
    return ", ".join(f"{a / b:.3f}" for a, b in zip(got["wall"], ref["wall"]))


def switch_cost(s: Setup, a: Plan, b: Plan, n: int) -> list[float]:
    """Seconds of `AppliedPlan.remove()` + `apply_plan` of the other plan, alternating a and b."""
    model = LitHF(tiny_bert(s.layers, s.hidden, 0.1))
    blocks = resolve_blocks(model, None)[2]
    handle = apply_plan(blocks, a)
    out = []
    for i in range(n):
        nxt = b if i % 2 == 0 else a
        t0 = time.perf_counter()
        handle.remove()
        handle = apply_plan(blocks, nxt)
        out.append(time.perf_counter() - t0)
    handle.remove()
    return out


def describe_plan(plan: Plan) -> str:
    if not plan.segments:
        return "nothing checkpointed"
    return f"{len(plan.checkpointed)}/{plan.n_blocks} blocks in {len(plan.segments)} segment(s)"


def noise_line(label: str, a: dict, b: dict) -> str:
    """The spread of two copies of one run: all their medians, and the ratio within each round."""
    medians = a["wall"] + b["wall"]
    cpu = a["cpu"] + b["cpu"]
    return (f"noise: {label} timed as 2 entries per round, medians {', '.join(f'{1e3 * m:.1f}' for m in medians)} ms "
            f"-> max/min {max(medians) / min(medians):.3f} (cpu clock {max(cpu) / min(cpu):.3f}); within a round, "
            f"{label} / {label} (2nd) {by_round(a, b)}")


def length_of(shape) -> int:
    return shape.shapes[0][1]  # input_ids: [batch, length]


def variable_lengths(s: Setup, lengths: list[int], budget: int, longest_plan: Plan) -> str:
    """Part 1: the seeded lengths under per-shape planning, the longest plan and no checkpointing."""
    shape_cbs: list[ActivationCheckpointing] = []

    def per_shape(first) -> StepTimes:
        shape_cbs.append(callback(s, budget))
        return fit(s, lengths, [shape_cbs[-1]], first=first)[0]

    runs = {
        "per-shape": per_shape,
        "longest-plan": lambda first: fit(s, lengths, plan=longest_plan, first=first)[0],
        "none": lambda first: fit(s, lengths, first=first)[0],
        "none (2nd)": lambda first: fit(s, lengths, first=first)[0],
    }
    t0 = time.perf_counter()
    timed = rounds_of(runs, s.rounds, keep=lambda i: i >= SKIP)
    t_timing = time.perf_counter() - t0

    cb = shape_cbs[0]
    spent = [(c.engine._shapes.profile_s, c.engine._shapes.plan_s) for c in shape_cbs]  # per round, before any reuse
    decisions = list(cb.engine._shapes.plans.values())
    first_plans = dict(cb.plans)
    # per-shape's peak run reuses the last round's callback (a second fit, on a new model, profiles and
    # plans as the first did); checked below to give the first round's plans
    reused = shape_cbs[-1] if len(shape_cbs) > 1 else callback(s, budget)
    t0 = time.perf_counter()
    peak_runs = {
        "per-shape": fit(s, lengths, [reused], peaks=True)[1],
        "longest-plan": fit(s, lengths, plan=longest_plan, peaks=True)[1],
        "none": fit(s, lengths, peaks=True)[1],
    }
    t_peaks = time.perf_counter() - t0

    ref = timed["none"]
    hook_s = [sum(timer.before) for timer in timed["per-shape"]["timers"]]  # the callback's batch-start hooks
    print()
    print(f"1. {len(lengths)} batches of varying length, {s.rounds} interleaved rounds, steps {SKIP + 1}..{len(lengths)} "
          f"timed ({len(lengths) - SKIP} per run), budget {format_bytes(budget)}")
    print()
    print("| run | median step ms | x none | x none (all timed steps) | s outside steps | steps over budget | worst peak / budget |")
    print("|---|---|---|---|---|---|---|")
    for name in ("per-shape", "longest-plan", "none"):
        peaks = peak_runs[name].peaks
        outside = f"{statistics.median(hook_s):.1f}" if name == "per-shape" else "-"
        print(f"| {name} | {1e3 * statistics.median(timed[name]['wall']):.1f} | {ratio(timed[name], ref, 'wall'):.3f} | "
              f"{total(timed[name], ref):.3f} | {outside} | {sum(p > budget for p in peaks)}/{len(peaks)} | "
              f"{max(peaks) / budget:.3f} |")
    print()
    print(noise_line("none", ref, timed["none (2nd)"]))
    print(f"by round (wall): per-shape / none {by_round(timed['per-shape'], ref)}; longest-plan / none "
          f"{by_round(timed['longest-plan'], ref)}; per-shape / longest-plan "
          f"{by_round(timed['per-shape'], timed['longest-plan'])}")
    print("median step ms: median over rounds of each run's median step (wall clock); x none: median over rounds of "
          "the ratio of medians within a round; all timed steps: the same for the sums of the timed steps")
    print("s outside steps: wall seconds in ActivationCheckpointing.on_train_batch_start over the whole run "
          "(profiling, cost lookups and fit checks, planning, switching), median over rounds")

    profiled = [d for d in decisions if d.source == "profiled"]
    sources = Counter(d.source.split(" ")[0] for d in decisions)
    plan_ms = [1e3 * d.plan_s for d in decisions]
    by_length = {length_of(d.shape): d.plan for d in decisions}
    steps_plans = [by_length[n] for n in lengths]
    switches = sum(not same_regions(a, b) for a, b in zip(steps_plans, steps_plans[1:]))
    distinct = {(p.segments, p.inner_segments) for p in by_length.values()}
    same_plans = set(reused.plans) == set(first_plans) and all(
        same_regions(reused.plans[sh], p) for sh, p in first_plans.items()
    )
    print()
    print(f"per-shape (first round's callback): {len(decisions)} distinct shapes, {len(distinct)} distinct plans "
          f"({sum(not p.segments for p in by_length.values())} shapes with nothing checkpointed), "
          f"{switches} plan switches over {len(lengths)} steps, all predicted to fit: "
          f"{all(p.fits for p in by_length.values())}")
    print(f"  cost of each shape from: {', '.join(f'{k} {v}' for k, v in sorted(sources.items()))}")
    print(f"  profiling: {cb.profiled_steps} real batches profiled (lengths "
          f"{', '.join(str(length_of(d.shape)) for d in profiled)}), {cb.profile_runs} profiles with prefixes, "
          f"{cb.engine._shapes.profile_s:.1f} s in all; per profiled shape median "
          f"{statistics.median(d.profile_s for d in profiled):.2f} s, max {max(d.profile_s for d in profiled):.2f} s; "
          f"per distinct shape {cb.engine._shapes.profile_s / len(decisions):.2f} s")
    if cb.engine._shapes.slice_error:
        print(f"  prefixes dropped: {cb.engine._shapes.slice_error}")
    print(f"  planning: {len(decisions)} new shapes, median {statistics.median(plan_ms):.1f} ms, max {max(plan_ms):.1f} ms, "
          f"{cb.engine._shapes.plan_s:.1f} s in all")
    for r, ((prof, plan_s), h) in enumerate(zip(spent, hook_s)):
        print(f"  round {r + 1}: {h:.1f} s outside steps = profiling {prof:.1f} s + planning {plan_s:.1f} s + "
              f"the rest {h - prof - plan_s:.1f} s (cost lookups with their fit checks, switches)")
    for family in cb.engine._shapes.families.values():
        fitted = family.shape_profile(own_only=True)
        err = None if fitted is None else fitted.fit_error(s.batch)
        if err is not None:
            print(f"  quadratic over the {len(fitted.lengths)} real batches' profiles: worst leave-one-out miss "
                  f"{100 * err:.1f} % (the fit stands in for a profile only within {100 * FIT_TOLERANCE:.0f} %)")
    print(f"  the peak run reused the last round's callback (profiled and planned again): same plans as round 1 "
          f"for every shape: {same_plans}")
    a = longest_plan
    b = next((p for p in by_length.values() if p.segments and not same_regions(p, a)), None)
    b = b if b is not None else next(p for p in by_length.values() if not same_regions(p, a))
    sw = switch_cost(s, a, b, s.switches)
    p95 = sorted(sw)[int(0.95 * (len(sw) - 1))]
    print(f"  plan switch (AppliedPlan.remove() + apply_plan, {describe_plan(a)} <-> {describe_plan(b)}): median "
          f"{1e6 * statistics.median(sw):.0f} us, 95th percentile {1e6 * p95:.0f} us, max {1e6 * max(sw):.0f} us "
          f"over {len(sw)} switches")
    return f"timing runs {t_timing:.0f} s, peak runs {t_peaks:.0f} s"


def long_first(s: Setup, longest: int, budget: int, longest_plan: Plan) -> None:
    """Part 2: long batches, then short ones: per-shape planning against the short length's own plan."""
    rev = [longest] * s.reverse_long + [s.shortest] * s.reverse_short
    first_timed = s.reverse_long + s.reverse_skip
    short_plan = plan_at(s, s.shortest, budget)
    rev_cbs: list[ActivationCheckpointing] = []

    def per_shape(first) -> StepTimes:
        rev_cbs.append(callback(s, budget))
        return fit(s, rev, [rev_cbs[-1]], first=first)[0]

    runs = {
        "per-shape": per_shape,
        "short-own": lambda first: fit(s, rev, plan=short_plan, first=first)[0],
        "longest-plan": lambda first: fit(s, rev, plan=longest_plan, first=first)[0],
        "short-own (2nd)": lambda first: fit(s, rev, plan=short_plan, first=first)[0],
    }
    timed = rounds_of(runs, s.reverse_rounds, keep=lambda i: i >= first_timed)
    at_short = next(d for d in rev_cbs[0]._shapes.plans.values() if length_of(d.shape) == s.shortest)
    print()
    print(f"2. reverse order: {s.reverse_long} batches at {longest}, then {s.reverse_short} at {s.shortest}; short steps "
          f"{first_timed + 1}..{len(rev)} timed, {s.reverse_rounds} interleaved rounds")
    print(f"   short-own: the plan made at length {s.shortest} only ({describe_plan(short_plan)}); per-shape's plan at "
          f"{s.shortest}: {describe_plan(at_short.plan)}, same regions as short-own: "
          f"{same_regions(at_short.plan, short_plan)}; its cost at {s.shortest}: {at_short.source}")
    print()
    print("| run | median short step ms | per-shape / run | per-shape / run (paired steps) |")
    print("|---|---|---|---|")
    for name in ("per-shape", "short-own", "longest-plan"):
        print(f"| {name} | {1e3 * statistics.median(timed[name]['wall']):.1f} | "
              f"{ratio(timed['per-shape'], timed[name], 'wall'):.3f} | "
              f"{paired(timed['per-shape'], timed[name]):.3f} |")
    print()
    print(f"by round (wall): per-shape / short-own {by_round(timed['per-shape'], timed['short-own'])}; "
          f"per-shape / longest-plan {by_round(timed['per-shape'], timed['longest-plan'])}")
    print(noise_line("short-own", timed["short-own"], timed["short-own (2nd)"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 small layers, batch 8, 12 batches: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds of timing in both parts (default 3 and 4, quick 2)")
    parser.add_argument("--case", choices=("padded", "new-shapes"), default="padded",
                        help="new-shapes: a multi-scale CNN and lengths that keep growing (benchmarks/shape_cases.py)")
    parser.add_argument("--runs", type=int, default=3, help="new-shapes: fresh runs of each case, one row each")
    args = parser.parse_args(argv)
    if args.case == "new-shapes":
        from shape_cases import main as new_shapes

        new_shapes(args.runs)
        return
    s = QUICK if args.quick else FULL
    if args.rounds:
        s = dataclasses.replace(s, rounds=args.rounds, reverse_rounds=args.rounds)
    if "OMP_NUM_THREADS" not in os.environ:
        print("note: OMP_NUM_THREADS is not set; using torch.set_num_threads(1)", file=sys.stderr)
    torch.set_num_threads(1)
    quiet()
    started = time.perf_counter()
    lengths = s.lengths()
    longest = max(lengths)
    print(
        f"lightning-ckpt variable-shape benchmark: torch {torch.__version__}, {torch.get_num_threads()} thread(s) "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), {platform.machine()} CPU, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start, fp32, AdamW, "
        f"{'quick' if args.quick else 'full'} run"
    )
    print(
        f"model: HF BertForSequenceClassification from config, {s.layers} layers, hidden {s.hidden}, dropout 0.1, "
        f"batch {s.batch}; {len(lengths)} batches padded per batch by DataCollatorWithPadding, lengths drawn from "
        f"{s.shortest}..{s.longest} (seed 0), first at {lengths[0]}, longest {longest}, {len(set(lengths))} distinct"
    )
    print(f"lengths: {' '.join(map(str, lengths))}")
    print("every callback runs with tune_allocator=False (glibc's default malloc in every run: the plans are compared)")

    none_long, full_long = predicted_peaks(s, longest)
    none_short, full_short = predicted_peaks(s, s.shortest)
    budget = (none_long + full_long) // 2
    print(
        f"budget {format_bytes(budget)}: half way between none {format_bytes(none_long)} and full "
        f"{format_bytes(full_long)} at length {longest} (at {s.shortest}: none {format_bytes(none_short)}, "
        f"full {format_bytes(full_short)})"
    )
    longest_plan = plan_at(s, longest, budget)
    print(f"longest-plan (made at length {longest}): {describe_plan(longest_plan)}, "
          f"predicted {format_bytes(longest_plan.predicted_peak_bytes)}")
    part1 = variable_lengths(s, lengths, budget, longest_plan)
    long_first(s, longest, budget, longest_plan)
    print()
    print(f"time: {part1}, all {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
