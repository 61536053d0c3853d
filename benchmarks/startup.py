"""What the callback adds to the first training batch: fit start -> first step, split by phase.

    OMP_NUM_THREADS=1 python benchmarks/startup.py                     # both examples, about 1.5 min here
    OMP_NUM_THREADS=1 python benchmarks/startup.py --models encoder --rounds 2 --baseline
    OMP_NUM_THREADS=1 python benchmarks/startup.py --models swin convnext llama-long --timings first --cprofile 25

Each run is a fresh process that builds the example from its config (configs/encoder48.yaml,
configs/cnn.yaml) through the example's LightningCLI, with validation off, a CSV logger under a
temporary directory and `--steps` training steps. The callback's arguments are the config's, with
`tune_allocator` set by `--tune-allocator` (``false`` by default: the step is timed as the user's
default training would run it) and `report` by `--report`. Phases are timed by wrapping the
library's functions from here (nothing in the library is timed for this):

  probes       `profiler.probe_step` (forward and backward under the tracker and counters), less:
  block timing `time_blocks` (a forward without grad, each block timed)
  no-save fwd  `nosave_forward_peaks` (a forward without grad under the tracker)
  rates        `rates.measure_rates` (the machine's rate microbenchmarks)
  calibration  `keep_calibration.calibrated_profile` (op-level plans in `time` only)
  planning     `policies.make_plan` and `target_plan.plan_for_*` outside the report
  applying     `apply_plan` (the hooks or the compiled regions)
  report       `report.write_report` (the JSON; the trade-off PNG, its curves planned and drawn, is made
               on a thread of its own while training goes on: its cost shows only as the training
               thread's share of the interpreter lost to it, in "other")
  other        the rest of the first batch above one steady step: what a first step costs more
               than a steady one anyway (optimizer state created, fresh pages; `--baseline` runs
               each model without the callback to show it), Lightning's hooks, the static memory,
               the profile's fit, logging

Each callback run is done twice: "first run" with an empty folder of kept timings
(`profiling.machine.measured_cache`), so it measures the machine's rates and any calibration as a first
run on a machine does, and "timings kept" reading the folder one untimed run filled, as every
later run on the machine does (`--timings first|kept|both`).

`swin`, `convnext` and `llama-long` run a plain loop around `auto_checkpoint` instead
(`PLAIN_MODELS`): HF Swin (224 px, embed 48, depths 2/2/6/2, batch 8) and HF ConvNeXt (hidden 48/96/192/384,
224 px, batch 12) from config with `blocks=None` and a budget 0.3 of the way from the `full` plan's predicted
peak to the unplanned one's; HF Llama (8 layers, hidden 128, 4 heads, attention dropout 0.1) at (1, 2048) over
`model.layers` with a budget 10 % above the `full` plan's measured peak (`profile_peak._full_peak`). Their first
batch is `auto_checkpoint` plus the first `handle.step` and step; "fit -> first batch" is 0. Lengths that grow
during training: `benchmarks/profile_peak.py --cases grow` prints the library's share of the run.
`--cprofile N` also prints the first batch's N costliest functions in process CPU time (cumulative).

"first batch" is the wall time from the first training batch's start hook (before the callback's)
to its end hook (after the callback's); "steady" the median of the batches after the second;
"overhead" = first batch - steady, in steps ("in CPU time": the same ratio in process CPU time,
steadier on a loaded machine). "fit -> first batch" is the time from `trainer.fit`
to that first batch's start (setup, the allocator setting, the blocks found, the loader built).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

CONFIGS = {"encoder": ROOT / "configs" / "encoder48.yaml", "cnn": ROOT / "configs" / "cnn.yaml"}
DEFAULT_STEPS = {"encoder": 5, "cnn": 12, "swin": 5, "convnext": 5, "llama-long": 4}
# A worker process takes seconds to a few minutes; one still running after an hour hangs.
WORKER_TIMEOUT_S = 3600
PLAIN_MODELS = ("swin", "convnext", "llama-long")
PHASES = ("discovery", "probes", "block timing", "no-save fwd", "rates", "calibration", "planning", "applying", "report")
# (module, attribute, phase); a phase marked sticky takes everything that runs inside it
PATCHES = (
    ("lightning_ckpt.profiling.structure.discovery", "discover_chain", "discovery"),
    ("lightning_ckpt.profiling.passes.profiler", "probe_step", "probes"),
    ("lightning_ckpt.profiling.passes.profiler", "_time_blocks", "block timing"),
    ("lightning_ckpt.profiling.passes.profiler", "_nosave_forward_peaks", "no-save fwd"),
    ("lightning_ckpt.profiling.passes.forward_passes", "time_blocks", "block timing"),
    ("lightning_ckpt.profiling.passes.forward_passes", "nosave_forward_peaks", "no-save fwd"),
    ("lightning_ckpt.profiling.machine.rates", "measure_rates", "rates"),
    ("lightning_ckpt.apply.keep_calibration", "calibrated_profile", "calibration"),
    ("lightning_ckpt.planning.policies", "make_plan", "planning"),
    ("lightning_ckpt.engine.target_plan", "plan_for_target", "planning"),
    ("lightning_ckpt.engine.target_plan", "plan_for_max", "planning"),
    ("lightning_ckpt.frontends.lightning.compiled", "apply_plan", "applying"),
    ("lightning_ckpt.apply.segments", "apply_plan", "applying"),
    ("lightning_ckpt.report.files", "write_report", "report"),
)
STICKY = {"report"}


class PhaseClock:
    """Exclusive wall time per phase on the training thread: a phase's time leaves out the phases
    that run inside it, except inside a sticky phase, which keeps all of its time."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[list[Any]] = []

    def wrap(self, fn, phase: str):
        clock = self

        def timed(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)  # the report's plot, drawn beside the training thread: not its time
            if any(name in STICKY for name, _ in clock._stack):
                return fn(*args, **kwargs)
            clock._push(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                clock._pop()

        timed.__wrapped__ = fn
        return timed

    def _push(self, phase: str) -> None:
        now = time.perf_counter()
        if self._stack:
            top = self._stack[-1]
            self.totals[top[0]] = self.totals.get(top[0], 0.0) + now - top[1]
        self._stack.append([phase, now])
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def _pop(self) -> None:
        now = time.perf_counter()
        phase, start = self._stack.pop()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - start
        if self._stack:
            self._stack[-1][1] = now


def install(clock: PhaseClock) -> None:
    """Wrap each function of `PATCHES` wherever a loaded lightning_ckpt module holds it."""
    import importlib

    for module, attr, phase in PATCHES:
        try:
            original = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue  # the library moved it: that phase reads 0 and lands in "other"
        if hasattr(original, "__wrapped__"):
            continue  # timed already, under another name
        timed = clock.wrap(original, phase)
        for name, mod in list(sys.modules.items()):
            if name.startswith("lightning_ckpt") and mod is not None:
                for key, value in list(vars(mod).items()):
                    if value is original:
                        setattr(mod, key, timed)


def worker(model: str, steps: int, tune_allocator: str, report: bool, callback: bool = True, top: int = 0) -> dict:
    import lightning.pytorch as pl
    import torch
    import yaml

    torch.set_num_threads(1)
    example = __import__("train_encoder" if model == "encoder" else "train_cnn")
    log_dir = tempfile.mkdtemp(prefix=f"lckpt-startup-{model}-")
    args = [
        "--config", str(CONFIGS[model]), f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={log_dir}",
    ]
    cli = example.main(args, run=False)
    trainer = cli.trainer

    import lightning_ckpt
    from lightning_ckpt.frontends.lightning.callback import ActivationCheckpointing

    config = yaml.safe_load(CONFIGS[model].read_text())
    init = next(
        c["init_args"] for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ActivationCheckpointing")
    )
    init = dict(init, report=report, verbose=False)
    if tune_allocator != "default":
        init["tune_allocator"] = tune_allocator == "true"
    ckpt = lightning_ckpt.ActivationCheckpointing(**init)
    times: dict[str, Any] = {"batch_start": [], "batch_end": [], "cpu_start": [], "cpu_end": []}

    profiler = _profiler(top)

    class Start(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            times["batch_start"].append(time.perf_counter())
            times["cpu_start"].append(time.process_time())
            if profiler is not None and len(times["batch_start"]) == 1:
                profiler.enable()

    class End(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if profiler is not None and len(times["batch_end"]) == 0:
                profiler.disable()
            times["cpu_end"].append(time.process_time())
            times["batch_end"].append(time.perf_counter())

    others = [c for c in trainer.callbacks if not isinstance(c, ActivationCheckpointing)]
    trainer.callbacks = [Start(), *([ckpt] if callback else []), *others, End()]
    clock = PhaseClock()
    install(clock)
    t_fit = time.perf_counter()
    trainer.fit(cli.model, datamodule=cli.datamodule)
    steps_s = [e - s for s, e in zip(times["batch_start"], times["batch_end"])]
    cpu_s = [e - s for s, e in zip(times["cpu_start"], times["cpu_end"])]
    json_path = next(Path(log_dir).rglob("lightning_ckpt_plan.json"), None)
    plan = ckpt.plan if callback else None
    return {
        "model": model if callback else f"{model}, no callback",
        "fit_to_first_s": times["batch_start"][0] - t_fit,
        "first_s": steps_s[0],
        "steady_s": statistics.median(steps_s[2:]),
        "steps_s": steps_s,
        "first_cpu_s": cpu_s[0],
        "steady_cpu_s": statistics.median(cpu_s[2:]),
        "phases": clock.totals,
        "calls": clock.calls,
        "json_bytes": None if json_path is None else json_path.stat().st_size,
        "checkpointed": None if plan is None else len(plan.checkpointed),
        "segments": None if plan is None else len(plan.segments),
        "inner": None if plan is None else len(plan.inner_segments),
        "profile_top": _top(profiler, top),
    }


def _profiler(top: int):
    """A cProfile profiler on process CPU time when `top` functions are asked for, else None."""
    import cProfile

    return cProfile.Profile(time.process_time) if top else None


def _top(profiler, top: int) -> str:
    """The `top` costliest functions `profiler` saw, by cumulative CPU time ("" without one)."""
    if profiler is None:
        return ""
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def _hf_model(model: str):
    """(fresh model, batch, loss of a batch, blocks) of one of `PLAIN_MODELS`, seeded."""
    import transformers

    torch = __import__("torch")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if model == "llama-long":
        from profile_peak import _llama

        ids = torch.randint(0, 96, (1, 2048), generator=g)
        built = _llama().train()
        return built, {"input_ids": ids, "labels": ids.clone()}, lambda b: built(**b).loss, "model.layers"
    if model == "swin":
        built = transformers.SwinForImageClassification(
            transformers.SwinConfig(image_size=224, embed_dim=48, depths=[2, 2, 6, 2], num_labels=10))
        size = 8
    else:
        built = transformers.ConvNextForImageClassification(
            transformers.ConvNextConfig(hidden_sizes=[48, 96, 192, 384], image_size=224, num_labels=10))
        size = 12
    built.train()
    batch = {"pixel_values": torch.randn(size, 3, 224, 224, generator=g), "labels": torch.randint(0, 10, (size,), generator=g)}
    return built, batch, lambda b: built(**b).loss, None


def _plain_budget(model: str) -> int:
    """The case's budget (see the module docstring), from a model of its own."""
    import torch

    from lightning_ckpt import make_plan
    from lightning_ckpt.engine.step_profile import profile_model
    from lightning_ckpt.engine.target_plan import cost_at
    from lightning_ckpt.profiling.structure.batch import batch_size_of
    from lightning_ckpt.profiling.structure.discovery import discover_chain
    from lightning_ckpt.profiling.memory.static_memory import static_memory

    built, batch, loss, _ = _hf_model(model)
    if model == "llama-long":
        from profile_peak import _full_peak, _held

        return int(1.1 * (_full_peak(built, list(built.model.layers), loss, batch) + _held(built, batch)))
    choice = discover_chain(built, loss, batch)
    profile = profile_model(built, list(choice.modules), loss, batch, names=list(choice.names), timing=False)
    opt = torch.optim.AdamW(built.parameters(), lr=1e-3)
    cost = cost_at(profile, batch_size_of(batch), static_memory(built, [opt]))
    full, none = (make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
    return int(full + 0.3 * (none - full))


def plain_worker(model: str, steps: int, top: int) -> dict:
    """One of `PLAIN_MODELS` in a plain loop: `auto_checkpoint` and the first step timed as the first batch."""
    import warnings

    import torch

    from lightning_ckpt import auto_checkpoint

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    budget = _plain_budget(model)
    built, batch, loss, blocks = _hf_model(model)
    opt = torch.optim.AdamW(built.parameters(), lr=1e-3)
    clock = PhaseClock()
    install(clock)
    wall, cpu, handle, said = [], [], None, []
    profiler = _profiler(top)
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        if i == 0 and profiler is not None:
            profiler.enable()
        if handle is None:
            handle = auto_checkpoint(built, budget, example_batch=batch, step_fn=loss, optimizer=opt, blocks=blocks,
                                     verbose=False, info=said.append)
        handle.step(batch)
        loss(batch).backward()
        opt.step()
        opt.zero_grad()
        if i == 0 and profiler is not None:
            profiler.disable()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    plan = handle.plan
    handle.remove()
    return {
        "model": model, "fit_to_first_s": 0.0, "first_s": wall[0], "steady_s": statistics.median(wall[2:]),
        "steps_s": wall, "first_cpu_s": cpu[0], "steady_cpu_s": statistics.median(cpu[2:]), "phases": clock.totals,
        "calls": clock.calls, "json_bytes": None, "checkpointed": len(plan.checkpointed), "segments": len(plan.segments),
        "inner": len(plan.inner_segments), "blocks": plan.n_blocks, "said": [s for s in said if "planning over" in s],
        "profile_top": _top(profiler, top),
    }


def _run(model: str, steps: int, tune_allocator: str, report: bool, callback: bool = True, kept_in: str | None = None,
         top: int = 0) -> dict:
    """One fresh process. `kept_in`: the folder of kept timings it reads (None: a new empty one, so
    it measures the rates and the calibration as a first run on a machine does)."""
    if model in PLAIN_MODELS:
        cmd = [sys.executable, __file__, "--plain-worker", json.dumps([model, steps, top])]
    else:
        cmd = [sys.executable, __file__, "--worker", json.dumps([model, steps, tune_allocator, report, callback, top])]
    with tempfile.TemporaryDirectory(prefix="lckpt-startup-timings-") as empty:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_CKPT_CACHE_DIR": kept_in or empty}
        env.pop("LIGHTNING_CKPT_REMEASURE", None)
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=ROOT,
                             timeout=WORKER_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if callback:
        result["model"] += ", timings kept" if kept_in else ", first run"
    return result


def _row(r: dict) -> str:
    steady = r["steady_s"]
    ph = r["phases"]
    timed = sum(ph.get(p, 0.0) for p in PHASES)
    other = r["first_s"] - steady - timed
    cells = [f"{ph.get(p, 0.0):.2f}" for p in PHASES]
    overhead = r["first_s"] - steady
    size = "-" if r["json_bytes"] is None else f"{r['json_bytes'] / 1e6:.2f} MB"
    cpu = (r["first_cpu_s"] - r["steady_cpu_s"]) / r["steady_cpu_s"]
    return (
        f"| {r['model']} | {r['fit_to_first_s']:.2f} | {' | '.join(cells)} | {other:.2f} | {r['first_s']:.2f} | "
        f"{steady:.2f} | {overhead:.2f} | {overhead / steady:.2f} | {cpu:.2f} | {size} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["encoder", "cnn"], choices=[*sorted(CONFIGS), *PLAIN_MODELS])
    ap.add_argument("--rounds", type=int, default=1, help="fresh processes per model, interleaved")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default: encoder 5, cnn 12)")
    ap.add_argument("--tune-allocator", choices=["default", "true", "false"], default="false")
    ap.add_argument("--report", choices=["true", "false"], default="true")
    ap.add_argument("--baseline", action="store_true", help="also run each model without the callback: its first batch")
    ap.add_argument(
        "--timings", choices=["first", "kept", "both"], default="both",
        help="first: every run measures the rates (and calibration) in an empty folder of kept timings, as a "
        "first run on a machine does; kept: they are read from a folder one untimed run filled, as later runs do",
    )
    ap.add_argument("--json", help="also write every run's figures to this file")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="the first batch's N costliest functions in process CPU time (cProfile; slows the batch)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--plain-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))))
        return 0
    if args.plain_worker:
        print(json.dumps(plain_worker(*json.loads(args.plain_worker))))
        return 0
    import torch

    runs: list[dict] = []
    started = time.time()
    report = args.report == "true"
    kept = tempfile.mkdtemp(prefix="lckpt-startup-kept-")
    if args.timings != "first":
        for model in args.models:  # untimed: fills the folder the "timings kept" runs read
            _run(model, args.steps or DEFAULT_STEPS[model], args.tune_allocator, report, kept_in=kept, top=0)
    for _ in range(args.rounds):
        for model in args.models:
            steps = args.steps or DEFAULT_STEPS[model]
            if args.timings != "kept":
                runs.append(_run(model, steps, args.tune_allocator, report, top=args.cprofile))
            if args.timings != "first":
                runs.append(_run(model, steps, args.tune_allocator, report, kept_in=kept, top=args.cprofile))
            if args.baseline and model not in PLAIN_MODELS:
                runs.append(_run(model, steps, args.tune_allocator, report, callback=False))
    print(
        f"lightning-ckpt startup benchmark: torch {torch.__version__}, OMP_NUM_THREADS=1, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the end; tune_allocator={args.tune_allocator}, report={args.report}; "
        f"seconds of wall time\n"
    )
    print(
        "| model | fit -> first batch | " + " | ".join(PHASES)
        + " | other | first batch | steady step | overhead | overhead / step | in CPU time | report JSON |"
    )
    print("|---" * (len(PHASES) + 9) + "|")
    for r in runs:
        print(_row(r))
    for r in runs:
        if r["checkpointed"] is None:
            continue
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["calls"].items()))
        print(f"\n{r['model']}: plan {r['checkpointed']} checkpointed in {r['segments']} segments "
              f"({r['inner']} inner); calls: {calls}")
        for line in r.get("said", []):
            print(f"  {line}")
        if r.get("profile_top"):
            print(r["profile_top"])
    print(f"\n(total wall time {time.time() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
