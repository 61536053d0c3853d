"""Variable batch shapes: a plan per shape against one plan for the longest shape, measured side by side.

    OMP_NUM_THREADS=1 python benchmarks/shapes.py           # BERT, 12 layers, batch 16, 48 batches
    OMP_NUM_THREADS=1 python benchmarks/shapes.py --quick   # 4 small layers, batch 8, 12 batches

HF BERT (`BertForSequenceClassification` built from config: 12 layers, hidden 64, dropout 0.1,
AdamW) trains on batches padded per batch by `DataCollatorWithPadding`, so each batch has its
own length (a seeded list drawn from 32..128, the first batch at 32). The budget is half way
between the `none` and `full` predicted peaks at the longest length (the callback's own
prediction at that length), so the long batches need checkpointing and the short ones none.
Every run is a fresh model from the same seed on the same batches:

1. `per-shape`: `ActivationCheckpointing` at that budget, planning each batch shape;
2. `longest-plan`: the callback's plan at the longest length (made on data of only that
   length), applied by hand with `apply_plan` to every step, no callback;
3. `none`: no checkpointing (over the budget on the long batches; reported, not an error).

`tune_allocator=False` in every callback, so all runs use glibc's default malloc and the
comparison is of the plans alone. A step is timed by a callback placed after
`ActivationCheckpointing`, from its `on_train_batch_start` to its `on_train_batch_end`: the
profiling and planning the callback does in its own `on_train_batch_start` fall outside the
step time and are reported separately. The first `SKIP` steps of a run are left out. Runs are
interleaved: each round runs every configuration once (rotated order), `none` twice as separate
entries, and a ratio is the median over rounds of a run's median step over the same round's
`none`; the noise is max / min of all `none` medians. Peaks come from a second, untimed run of
each configuration with `StepPeaks` (the live-storage tracker over the whole step, which slows
steps).

The reverse order check trains long batches first, then short ones, and times the short
batches under per-shape planning, under the short length's own plan applied by hand (made at
that length only) and under the longest plan.
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
from lightning_ckpt.planning.plan import Plan, format_bytes  # noqa: E402
from lightning_ckpt.planning.shape_profile import FIT_TOLERANCE  # noqa: E402
from lightning_ckpt.shape_plans import same_regions  # noqa: E402

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
    reverse_long: int  # long batches at the start of the reverse order check
    reverse_short: int  # short batches after them
    reverse_skip: int  # short batches left out (the first after the long ones)
    switches: int  # plan switches timed

    def lengths(self, seed: int = 0) -> list[int]:
        """`n_batches` lengths drawn from shortest..longest, the first batch at the shortest."""
        rng = random.Random(seed)
        return [self.shortest] + [rng.randint(self.shortest, self.longest) for _ in range(self.n_batches - 1)]


FULL = Setup(layers=12, hidden=64, batch=16, n_batches=48, shortest=32, longest=128, rounds=3,
             reverse_long=4, reverse_short=12, reverse_skip=2, switches=200)
QUICK = Setup(layers=4, hidden=32, batch=8, n_batches=12, shortest=16, longest=64, rounds=2,
              reverse_long=3, reverse_short=6, reverse_skip=1, switches=50)


class StepTimes(pl.Callback):
    """Wall and process CPU time of each step, from this callback's batch start to its batch end;
    with `mark` (a callback placed first) also the time the callbacks between them took."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.before: list[float] = []  # wall seconds from `mark`'s batch start to this one's
        self.lengths: list[int] = []
        self._t0 = (0.0, 0.0)
        self._marked = None

    def mark(self) -> pl.Callback:
        timer = self

        class Mark(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                timer._marked = time.perf_counter()

        return Mark()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lengths.append(int(batch["input_ids"].shape[1]))
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
    out = {name: {"wall": [], "cpu": [], "timers": []} for name in runs}
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 small layers, batch 8, 12 batches: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds of timing (default 3, quick 2)")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    if args.rounds:
        s = dataclasses.replace(s, rounds=args.rounds)
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

    # ---------------------------------------------------------------- 1. the variable-length run
    shape_cbs: list[ActivationCheckpointing] = []

    def per_shape(first) -> StepTimes:
        cb = callback(s, budget)
        shape_cbs.append(cb)
        return fit(s, lengths, [cb], first=first)[0]

    runs = {
        "per-shape": per_shape,
        "longest-plan": lambda first: fit(s, lengths, plan=longest_plan, first=first)[0],
        "none": lambda first: fit(s, lengths, first=first)[0],
        "none (2nd)": lambda first: fit(s, lengths, first=first)[0],
    }
    t_timing = time.perf_counter()
    timed = rounds_of(runs, s.rounds, keep=lambda i: i >= SKIP)
    t_timing = time.perf_counter() - t_timing

    spent = [(c._shapes.profile_s, c._shapes.plan_s) for c in shape_cbs]  # per round, before any reuse
    first_plans = dict(shape_cbs[0].plans)
    first_decisions = list(shape_cbs[0]._shapes.plans.values())
    # the peak run of per-shape reuses the last round's callback (a second fit on the same model
    # reuses its profiles and plans again): checked below to give the first round's plans
    reused = shape_cbs[-1] if len(shape_cbs) > 1 else callback(s, budget)
    t_peaks = time.perf_counter()
    peak_runs = {
        "per-shape": fit(s, lengths, [reused], peaks=True)[1],
        "longest-plan": fit(s, lengths, plan=longest_plan, peaks=True)[1],
        "none": fit(s, lengths, peaks=True)[1],
    }
    t_peaks = time.perf_counter() - t_peaks

    ref = timed["none"]
    none_medians = ref["wall"] + timed["none (2nd)"]["wall"]
    none_cpu = ref["cpu"] + timed["none (2nd)"]["cpu"]
    hook_s = [sum(timer.before) for timer in timed["per-shape"]["timers"]]  # the callback's batch-start hooks, per round
    print()
    print(f"1. {len(lengths)} batches of varying length, {s.rounds} interleaved rounds, steps {SKIP + 1}..{len(lengths)} "
          f"timed ({len(lengths) - SKIP} per run), budget {format_bytes(budget)}")
    print()
    print("| run | median step ms | x none (wall) | x none (cpu) | s outside steps | steps over budget | worst peak / budget |")
    print("|---|---|---|---|---|---|---|")
    for name in ("per-shape", "longest-plan", "none"):
        tracker = peak_runs[name]
        over = sum(p > budget for p in tracker.peaks)
        worst = max(tracker.peaks) / budget
        outside = f"{statistics.median(hook_s):.1f}" if name == "per-shape" else "-"
        print(f"| {name} | {1e3 * statistics.median(timed[name]['wall']):.1f} | {ratio(timed[name], ref, 'wall'):.3f} | "
              f"{ratio(timed[name], ref, 'cpu'):.3f} | {outside} | {over}/{len(tracker.peaks)} | {worst:.3f} |")
    print()
    pair = [a / b for a, b in zip(ref["wall"], timed["none (2nd)"]["wall"])]
    print(f"noise: `none` timed as 2 entries per round, medians "
          f"{', '.join(f'{1e3 * m:.1f}' for m in none_medians)} ms -> max/min {max(none_medians) / min(none_medians):.3f} "
          f"(cpu clock {max(none_cpu) / min(none_cpu):.3f}); within a round, none / none (2nd) "
          f"{', '.join(f'{x:.3f}' for x in pair)}")
    print("s outside steps: wall seconds in ActivationCheckpointing.on_train_batch_start over the whole run "
          "(profiling, cost lookups and fit checks, planning, switching), median over rounds")

    cb = shape_cbs[0]
    decisions = first_decisions
    same_plans = set(reused.plans) == set(first_plans) and all(
        same_regions(reused.plans[sh], p) for sh, p in first_plans.items()
    )
    profiled = [d for d in decisions if d.source == "profiled"]
    sources = Counter(d.source.split(" ")[0] for d in decisions)
    plan_ms = [1e3 * d.plan_s for d in decisions]
    by_length = {d.shape.shapes[0][1]: d.plan for d in decisions}
    steps_plans = [by_length[n] for n in lengths]
    switches = sum(not same_regions(a, b) for a, b in zip(steps_plans, steps_plans[1:]))
    distinct = {(p.segments, p.inner_segments) for p in by_length.values()}
    print()
    print(f"per-shape (first round's callback): {len(cb.plans)} distinct shapes, {len(distinct)} distinct plans "
          f"({sum(not p.segments for p in by_length.values())} shapes with nothing checkpointed), "
          f"{switches} plan switches over {len(lengths)} steps, all predicted to fit: "
          f"{all(p.fits for p in by_length.values())}")
    print(f"  cost of each shape from: {', '.join(f'{k} {v}' for k, v in sorted(sources.items()))}")
    print(f"  profiling: {cb.profiled_steps} real batches profiled (lengths "
          f"{', '.join(str(d.shape.shapes[0][1]) for d in profiled)}), {cb.profile_runs} profiles with prefixes, "
          f"{cb._shapes.profile_s:.1f} s in all; per profiled shape median "
          f"{statistics.median(d.profile_s for d in profiled):.2f} s, max {max(d.profile_s for d in profiled):.2f} s; "
          f"per distinct shape {cb._shapes.profile_s / len(decisions):.2f} s")
    if cb._shapes.slice_error:
        print(f"  prefixes dropped: {cb._shapes.slice_error}")
    print(f"  planning: {len(decisions)} new shapes, median {statistics.median(plan_ms):.1f} ms, max {max(plan_ms):.1f} ms, "
          f"{cb._shapes.plan_s:.1f} s in all")
    for r, ((prof, plan_s), h) in enumerate(zip(spent, hook_s)):
        print(f"  round {r + 1}: {h:.1f} s outside steps = profiling {prof:.1f} s + planning {plan_s:.1f} s + "
              f"the rest {h - prof - plan_s:.1f} s (cost lookups with their fit checks, switches)")
    for family in cb._shapes.families.values():
        fitted = family.shape_profile(own_only=True)
        err = None if fitted is None else fitted.fit_error(s.batch)
        if err is not None:
            print(f"  quadratic over the {len(fitted.lengths)} real batches' profiles: worst leave-one-out miss "
                  f"{100 * err:.1f} % (the fit stands in for a profile only within {100 * FIT_TOLERANCE:.0f} %)")
    print(f"  the peak run reused the last round's callback (profiles kept, planned again): same plans as round 1 "
          f"for every shape: {same_plans}")
    a = longest_plan
    b = next((p for p in by_length.values() if p.segments and not same_regions(p, a)), None)
    b = b if b is not None else next(p for p in by_length.values() if not same_regions(p, a))
    sw = switch_cost(s, a, b, s.switches)
    print(f"  plan switch (AppliedPlan.remove() + apply_plan, {describe_plan(a)} <-> {describe_plan(b)}): "
          f"median {1e6 * statistics.median(sw):.0f} us, max {1e6 * max(sw):.0f} us over {len(sw)} switches")

    # ---------------------------------------------------------------- 2. long batches first
    rev = [longest] * s.reverse_long + [s.shortest] * s.reverse_short
    first_timed = s.reverse_long + s.reverse_skip
    short_plan = plan_at(s, s.shortest, budget)
    rev_cbs: list[ActivationCheckpointing] = []

    def rev_per_shape(first) -> StepTimes:
        cb = callback(s, budget)
        rev_cbs.append(cb)
        return fit(s, rev, [cb], first=first)[0]

    rev_runs = {
        "per-shape": rev_per_shape,
        "short-own": lambda first: fit(s, rev, plan=short_plan, first=first)[0],
        "longest-plan": lambda first: fit(s, rev, plan=longest_plan, first=first)[0],
        "short-own (2nd)": lambda first: fit(s, rev, plan=short_plan, first=first)[0],
    }
    rev_timed = rounds_of(rev_runs, s.rounds, keep=lambda i: i >= first_timed)
    own = rev_timed["short-own"]
    own_medians = own["wall"] + rev_timed["short-own (2nd)"]["wall"]
    rcb = rev_cbs[0]
    rev_short = next(p for sh, p in rcb.plans.items() if sh.shapes[0][1] == s.shortest)
    print()
    print(f"2. reverse order: {s.reverse_long} batches at {longest}, then {s.reverse_short} at {s.shortest}; short steps "
          f"{first_timed + 1}..{len(rev)} timed, {s.rounds} interleaved rounds")
    print(f"   short-own: the plan made at length {s.shortest} only ({describe_plan(short_plan)}); per-shape's plan at "
          f"{s.shortest}: {describe_plan(rev_short)}, same regions as short-own: {same_regions(rev_short, short_plan)}; "
          f"its cost at {s.shortest}: {next(d.source for d in rcb._shapes.plans.values() if d.shape.shapes[0][1] == s.shortest)}")
    print()
    print("| run | median short step ms | per-shape / run (wall) | per-shape / run (cpu) |")
    print("|---|---|---|---|")
    for name in ("per-shape", "short-own", "longest-plan"):
        print(f"| {name} | {1e3 * statistics.median(rev_timed[name]['wall']):.1f} | "
              f"{ratio(rev_timed['per-shape'], rev_timed[name], 'wall'):.3f} | "
              f"{ratio(rev_timed['per-shape'], rev_timed[name], 'cpu'):.3f} |")
    print()
    pair = [a / b for a, b in zip(own["wall"], rev_timed["short-own (2nd)"]["wall"])]
    print(f"noise: short-own timed as 2 entries per round, medians {', '.join(f'{1e3 * m:.1f}' for m in own_medians)} ms "
          f"-> max/min {max(own_medians) / min(own_medians):.3f}; within a round, short-own / short-own (2nd) "
          f"{', '.join(f'{x:.3f}' for x in pair)}")
    print()
    print(f"time: timing runs {t_timing:.0f} s, peak runs {t_peaks:.0f} s, all {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
