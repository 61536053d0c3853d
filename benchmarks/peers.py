"""The comparison a user makes: HF transformers' own activation checkpointing against lightning-ckpt
at the same memory budgets, on HF Llama and on a hierarchical model, HF Swin.

    OMP_NUM_THREADS=1 python benchmarks/peers.py            # Llama 16 layers, Swin 224 px: 14 min on 2 loaded cores
    OMP_NUM_THREADS=1 python benchmarks/peers.py --quick    # smaller models, 2 rounds: a smoke run

Models from their configs with random weights, fp32 (Lightning's default precision), AdamW:
HF Llama (`_hf_examples.llama_example`: 16 layers, hidden 128, batch 8 x 128 tokens) and HF Swin
(`_hf_examples.swin_example`: 224 px, embed 48, depths 2/2/6/2, batch 8). HF's settings: no
checkpointing, and `model.activation_checkpointing_enable({"use_reentrant": False},
every_n_layers=k)` for k = 1, 2, 4, which flags every k-th `GradientCheckpointingLayer` in module
order (for Swin those are the four stages and the blocks inside them: k = 1 nests each stage's
blocks in its own checkpoint). HF's other option, `offload=True`, needs pinned memory and raises
on a machine without an accelerator. Each setting's peak is measured over one steady step by
the live-storage tracker (`measure_step_peak`: parameters, gradients, AdamW state, the batch and
every activation). The budgets are those peaks (0.1 % above them: `SLACK`) and the points half
way between neighbouring ones. At each, `auto_checkpoint` plans for that budget with its defaults (`cost_metric="time"`)
and `blocks="model.layers"` for Llama, `blocks=None` (found by the library) for Swin, as a user
would write it; its step is measured the same way.

Step times are process CPU time, interleaved: each round visits every setting (each its own copy
of the model, same weights) in an order rotated by one, runs one untimed warm-up step and then
timed steps. A setting's step time is the median over rounds of its median over no
checkpointing's in the same round; `rounds` gives its min..max. A budget's HF row is HF's
fastest setting whose measured peak fits it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _hf_examples import llama_example, swin_example  # noqa: E402
from _timing import Timed, round_ratios, time_rounds  # noqa: E402

from lightning_ckpt import InfeasibleBudgetError, auto_checkpoint, measure_step_peak  # noqa: E402
from lightning_ckpt.units import format_bytes  # noqa: E402

HF_EVERY = (1, 2, 4)  # the every_n_layers settings of HF's checkpointing
# A budget "at" an HF setting's peak is this much above the tracker's count of it: the library's
# predictions run a few KiB above the count (8 KiB of 52 MiB for Llama with every layer checkpointed),
# so at the exact byte its plan would need one block more than HF's; a user writes a round number.
SLACK = 1.001
HF_NAMES = {0: "HF no checkpointing", 1: "HF every layer", 2: "HF every 2nd layer", 4: "HF every 4th layer"}


@dataclass
class Run:
    """One setting of one model: what it checkpoints, its measured peak and its timed steps."""

    setting: str
    what: str
    peak_bytes: int
    timed: Timed


@dataclass
class Budget:
    """A budget, how it was chosen, and lightning-ckpt's run at it (None: no plan fits)."""

    bytes: int
    label: str
    ours: Run | None


def _trainer(example: Callable[[], tuple]) -> tuple[torch.nn.Module, Any, Any, Callable, torch.optim.Optimizer, Callable]:
    model, batch, _, chain, loss_fn, _ = example()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # small: many steps on one batch stay sane

    def step() -> None:
        loss = loss_fn(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return model, batch, chain, loss_fn, opt, step


def hf_flagged(model: torch.nn.Module) -> str:
    """HF's checkpointed layers, per class: `8/16 LlamaDecoderLayer (0, 2, ...)`."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    by_class: dict[str, list[bool]] = {}
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            by_class.setdefault(type(m).__name__, []).append(bool(m.gradient_checkpointing))
    parts = []
    for cls, flags in by_class.items():
        on = [i for i, f in enumerate(flags) if f]
        if not on:
            continue
        which = "" if len(on) == len(flags) else f" ({', '.join(map(str, on))})"
        parts.append(f"{len(on)}/{len(flags)} {cls}{which}")
    return "; ".join(parts) or "-"


def _short(names: list[str]) -> list[str]:
    """Block names without the prefix they all share (`swin.encoder.layers.0.blocks.1` -> `0.blocks.1`)."""
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind(".") + 1] if len(names) > 1 else ""
    return [n[len(prefix):] for n in names]


def our_plan(handle) -> str:
    plan, names = handle.plan, _short(handle.block_names)
    if not plan.segments:
        return "-"
    if len(plan.segments) > 4:
        return f"{len(plan.checkpointed)}/{len(names)} blocks in {len(plan.segments)} segments"
    segs = [names[a] if a == b else f"{names[a]}..{names[b]}" for a, b in plan.segments]
    return f"{len(plan.checkpointed)}/{len(names)} blocks: {', '.join(segs)}"


def hf_runs(example: Callable[[], tuple]) -> list[Run]:
    runs = []
    for k in (0, *HF_EVERY):
        model, batch, _, loss_fn, opt, step = _trainer(example)
        if k:
            model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=k)
        step()  # two warm-up steps: AdamW's state exists and last step's gradients are alive in the forward
        step()
        peak = measure_step_peak(model, loss_fn, batch, opt)
        runs.append(Run(HF_NAMES[k], hf_flagged(model) if k else "-", peak, Timed(HF_NAMES[k], step)))
    return runs


def budgets_of(hf: list[Run]) -> list[tuple[int, str]]:
    """Each HF setting's peak (with `SLACK`), and half way between neighbouring ones, largest first."""
    names: dict[int, list[str]] = {}
    for r in hf:  # settings of equal peaks share a budget
        names.setdefault(r.peak_bytes, []).append(r.setting.removeprefix("HF "))
    peaks = sorted(names, reverse=True)
    out = []
    for i, p in enumerate(peaks):
        out.append((int(p * SLACK), f"~ {', '.join(names[p])}"))
        if i + 1 < len(peaks):
            out.append(((p + peaks[i + 1]) // 2, "half way"))
    return out


def our_runs(example: Callable[[], tuple], budgets: list[tuple[int, str]], messages: list[str]) -> tuple[list[Budget], list]:
    """`auto_checkpoint` at each budget on a fresh copy; a plan equal to an earlier one is timed once."""
    out, handles, seen = [], [], {}
    for budget, label in budgets:
        model, batch, chain, loss_fn, opt, step = _trainer(example)
        try:
            handle = auto_checkpoint(
                model, budget, example_batch=batch, step_fn=loss_fn, optimizer=opt, blocks=chain, verbose=False,
                info=messages.append,
            )
        except InfeasibleBudgetError as err:
            messages.append(f"{format_bytes(budget)}: {err}")
            out.append(Budget(budget, label, None))
            continue
        def our_step(handle=handle, batch=batch, step=step) -> None:
            handle.step(batch)  # before each step, as a loop under auto_checkpoint does
            step()

        our_step()  # two warm-up steps as HF's; at the second the plan counts last step's gradients in the forward
        our_step()
        handle.step(batch)
        key = (tuple(handle.block_names), handle.plan.segments, handle.plan.keeps, handle.plan.inner_segments)
        if key in seen:
            handle.remove()
            out.append(Budget(budget, label, seen[key]))
            continue
        peak = measure_step_peak(model, loss_fn, batch, opt)
        run = Run("lightning-ckpt", our_plan(handle), peak, Timed(f"lightning-ckpt {format_bytes(budget)}", our_step))
        messages.append(f"{format_bytes(budget)}: {run.what}, predicted {format_bytes(handle.plan.predicted_peak_bytes)}, "
                        f"measured {format_bytes(peak)}")
        seen[key] = run
        handles.append(handle)
        out.append(Budget(budget, label, run))
    return out, handles


def compare(name: str, example: Callable[[], tuple], repeats: int, steps: int) -> tuple[list[str], list[str], list[str]]:
    """(full table rows, compact rows, notes) for one model."""
    hf = hf_runs(example)
    messages: list[str] = []
    budgets, handles = our_runs(example, budgets_of(hf), messages)
    ours = list({id(b.ours): b.ours for b in budgets if b.ours is not None}.values())
    try:
        time_rounds([r.timed for r in hf + ours], repeats, steps)
    finally:
        for h in handles:
            h.remove()
    base = hf[0].timed
    ratio = {id(r): statistics.median(round_ratios(r.timed, base, "cpu")) for r in hf + ours}
    spread = {id(r): round_ratios(r.timed, base, "cpu") for r in hf + ours}

    def row(budget: Budget, r: Run | None, setting: str) -> str:
        if r is None:
            return f"| {name} | {format_bytes(budget.bytes)} ({budget.label}) | {setting} | no plan fits | | NO | | |"
        fits = "yes" if r.peak_bytes <= budget.bytes else "NO"
        s = spread[id(r)]
        return (f"| {name} | {format_bytes(budget.bytes)} ({budget.label}) | {setting} | {r.what} | "
                f"{format_bytes(r.peak_bytes)} | {fits} | {ratio[id(r)]:.2f} | {min(s):.2f}..{max(s):.2f} |")

    full, compact = [], []
    for b in budgets:
        fitting = [r for r in hf if r.peak_bytes <= b.bytes]
        best = min(fitting, key=lambda r: ratio[id(r)]) if fitting else None
        full.append(row(b, best, best.setting if best else "HF: none fits"))
        full.append(row(b, b.ours, "lightning-ckpt"))
        hf_cell = (f"{best.setting.removeprefix('HF ')} | {format_bytes(best.peak_bytes)} | {ratio[id(best)]:.2f}"
                   if best else "none fits | | ")
        if b.ours is None:
            ours_cell = "no plan fits | | | "
        else:
            fits = "" if b.ours.peak_bytes <= b.bytes else " (over)"
            ours_cell = (f"{b.ours.what} | {format_bytes(b.ours.peak_bytes)}{fits} | {ratio[id(b.ours)]:.2f} | "
                         + (f"{ratio[id(b.ours)] / ratio[id(best)]:.2f}" if best else ""))
        compact.append(f"| {name} | {format_bytes(b.bytes)} ({b.label}) | {hf_cell} | {ours_cell} |")
    notes = [f"{name}: {len(hf)} HF settings and {len(ours)} distinct plans of ours, {repeats} rounds x {steps} "
             f"timed steps; no checkpointing steps {1e3 * base.median_s('cpu'):.0f} ms (CPU)"]
    notes += [f"  HF {r.setting.removeprefix('HF ')}: {r.what}, {format_bytes(r.peak_bytes)}, x{ratio[id(r)]:.2f}"
              for r in hf]
    notes += [f"  lightning-ckpt at {m}" for m in messages if not m.startswith("lightning-ckpt")]
    said = [m for m in messages if m.startswith("lightning-ckpt: blocks=None: planning")]
    notes += [f"  said by the library: {said[-1].splitlines()[0]}"] if said else []
    return full, compact, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and 2 rounds: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds (default: llama 5, swin 3; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per visit (default: llama 2, swin 1; quick 1)")
    parser.add_argument("--only", choices=("llama", "swin"), default=None, help="one model only")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    torch.set_num_threads(1)
    print(
        f"lightning-ckpt against HF's checkpointing: torch {torch.__version__}, {torch.get_num_threads()} thread(s) "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), {platform.machine()} CPU, "
        f"{os.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at start, fp32, "
        f"AdamW, {'quick' if args.quick else 'full'} run"
    )
    models = {
        "HF Llama": ("llama", lambda: llama_example(args.quick, bf16=False), (5, 2)),
        "HF Swin": ("swin", lambda: swin_example(args.quick), (3, 1)),
    }
    full, compact, notes = [], [], []
    for name, (key, example, (repeats, steps)) in models.items():
        if args.only not in (None, key):
            continue
        f, c, n = compare(name, example, args.repeats or (2 if args.quick else repeats),
                          args.steps or (1 if args.quick else steps))
        full, compact, notes = full + f, compact + c, notes + n
    print()
    print("| model | budget | setting | checkpointed | measured peak | fits | step time / no checkpointing | rounds |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(full))
    print()
    print("| model | budget | HF: fastest that fits | its peak | step / none | lightning-ckpt: checkpointed | "
          "its peak | step / none | / HF |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(compact))
    print()
    print("\n".join(notes))
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
