"""What an applied plan costs per training step, apart from profiling: HF Llama with no library,
with `auto_checkpoint`'s plan that checkpoints nothing, with HF's own checkpointing, and with our
plan on exactly the layers HF checkpoints.

    OMP_NUM_THREADS=1 python benchmarks/step_cost.py            # 16 layers, 8 rounds x 2 steps: 14 min on 2 loaded cores
    OMP_NUM_THREADS=1 python benchmarks/step_cost.py --quick    # 6 smaller layers, 2 rounds: a smoke run

HF Llama from its config (`_hf_examples.llama_example`: 16 layers, hidden 128, batch 8 x 128
tokens, AdamW), under bf16 autocast (Lightning's `bf16-mixed` on a CPU) and in fp32 (Lightning's
default precision). Each setting trains its own copy of the model (the same weights):

- `no library`, twice (the second copy is the noise floor between two identical settings);
- `ours, nothing checkpointed`: `auto_checkpoint` with `blocks="model.layers"`, a budget far above
  the step and every other argument at its default, so its plan checkpoints nothing; each step
  calls `handle.step(batch)` first, as a loop under it does (profiling happened before timing);
- `HF every layer` / `HF every 2nd layer`: `model.activation_checkpointing_enable({"use_reentrant":
  False}, every_n_layers=k)` (`gradient_checkpointing_enable` is its deprecated alias), which
  flags every k-th `GradientCheckpointingLayer` (layers 0, k, 2k, ...);
- `ours, HF's layers`: each layer HF flags is one checkpointed segment of ours, applied by
  `apply_segments` (what the engine calls with the plan it made, `guard_batchnorm` on).

Steps are timed interleaved: each round visits every setting once, in an order rotated by one
per round, runs one untimed warm-up step and then timed steps. A setting's number against
another is the median over rounds of the ratio of their medians in the same round; its spread
(min..max over rounds) is the noise the ratio is judged against.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _hf_examples import llama_example  # noqa: E402
from _timing import Timed, round_ratios, time_rounds  # noqa: E402

from lightning_ckpt import auto_checkpoint, resolve_blocks  # noqa: E402
from lightning_ckpt.apply.segments import apply_segments  # noqa: E402

EVERY = (1, 2)  # HF's every_n_layers settings compared
NOTHING_PLAN = 1.01  # the claim: the nothing-plan steps within 1 % of no library
SAME_PLAN = 1.02  # the claim: our plan on HF's layers steps within 2 % of HF's


def _trainer(quick: bool, bf16: bool):
    """A fresh copy of the example (same weights, same batch), its optimizer and one step of it."""
    model, batch, _, chain, loss_fn, name = llama_example(quick, bf16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # small: hundreds of steps on one batch stay sane

    def step() -> None:
        loss = loss_fn(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return model, batch, chain, loss_fn, opt, step, name


def hf_layers(model: torch.nn.Module) -> list[int]:
    """Indices of the decoder layers whose HF checkpointing flag is on."""
    return [i for i, layer in enumerate(model.model.layers) if getattr(layer, "gradient_checkpointing", False)]


def _layers(ids: list[int], n: int) -> str:
    if len(ids) == n:
        return f"all {n} layers"
    return f"layers {', '.join(map(str, ids))} ({len(ids)}/{n})"


def settings(quick: bool, bf16: bool) -> tuple[list[tuple[Timed, str]], dict[int, tuple[Timed, Timed]], str, list, Any]:
    """(setting, what it checkpoints) in timing order, HF's and ours by every_n_layers, the model's name,
    the handles to remove at the end (`auto_checkpoint`'s first) and the batch."""
    out, pairs, handles = [], {}, []
    for label in ("no library", "no library (2nd copy)"):
        _, _, _, _, _, step, name = _trainer(quick, bf16)
        out.append((Timed(label, step), "-"))

    model, batch, chain, loss_fn, opt, step, _ = _trainer(quick, bf16)
    handle = auto_checkpoint(
        model, "1TiB", example_batch=batch, step_fn=loss_fn, optimizer=opt, blocks=chain, verbose=False,
        info=lambda message: None,
    )
    if handle.plan.segments:
        raise RuntimeError(f"a 1 TiB budget made a plan that checkpoints {handle.plan.segments}; expected none")
    handles.append(handle)

    def ours_nothing(handle=handle, batch=batch, step=step) -> None:
        handle.step(batch)
        step()

    out.append((Timed("ours, nothing checkpointed", ours_nothing), "-"))

    for k in EVERY:
        model, _, _, _, _, step, _ = _trainer(quick, bf16)
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=k)
        ids = hf_layers(model)
        n = len(model.model.layers)
        what = "every layer" if k == 1 else f"every {k}nd layer" if k == 2 else f"every {k}th layer"
        hf = Timed(f"HF {what}", step)
        model, _, chain, _, _, step, _ = _trainer(quick, bf16)
        _, _, blocks = resolve_blocks(model, chain)
        handles.append(apply_segments(blocks, [(i, i) for i in ids]))
        ours = Timed(f"ours, HF's layers ({what})", step)
        out += [(hf, _layers(ids, n)), (ours, _layers(ids, n))]
        pairs[k] = (ours, hf)
    return out, pairs, name, handles, batch


def _noise(copies: list[float]) -> float:
    """How far apart two identical settings step: the larger of their ratio's distance from 1 and half
    the interquartile range of its rounds."""
    q = statistics.quantiles(copies, n=4) if len(copies) > 1 else [copies[0]] * 3
    return max(abs(statistics.median(copies) - 1), (q[2] - q[0]) / 2)


def _verdict(ratios: list[float], claim: float, noise: float) -> str:
    """'yes' when the median ratio is within the claim and the noise is smaller than the claim's
    margin, 'NO' when the ratio is above the claim by more than the noise, else not told apart."""
    m = statistics.median(ratios)
    if m <= claim and noise <= claim - 1:
        return f"yes (x{m:.3f})"
    if m > claim + noise:
        return f"NO (x{m:.3f})"
    return f"not told apart (x{m:.3f} at {100 * noise:.1f} % noise)"


def handle_step_s(handle, batch, calls: int = 200) -> float:
    """Median CPU time of `handle.step(batch)` alone, the plan already in place (what a step adds
    besides the hooks)."""
    times = []
    for _ in range(calls):
        t0 = time.process_time()
        handle.step(batch)
        times.append(time.process_time() - t0)
    return statistics.median(times)


def _range(xs: list[float]) -> str:
    return f"{min(xs):.3f}..{max(xs):.3f}"


def run(quick: bool, bf16: bool, repeats: int, steps: int) -> tuple[list[str], list[str], dict[str, str]]:
    entries, pairs, name, handles, batch = settings(quick, bf16)
    try:
        time_rounds([t for t, _ in entries], repeats, steps)
        handle_s = handle_step_s(handles[0], batch)
    finally:
        for h in handles:
            h.remove()
    base = entries[0][0]
    precision = "bf16-mixed" if bf16 else "fp32"
    ours_of = {id(ours): hf for ours, hf in pairs.values()}
    rows = []
    for t, what in entries:
        cpu = round_ratios(t, base, "cpu")
        wall = round_ratios(t, base, "wall")
        hf = ours_of.get(id(t))
        if hf is not None:
            same = round_ratios(t, hf, "cpu")
            same_wall = round_ratios(t, hf, "wall")
            vs_hf = f"{statistics.median(same):.3f} | {_range(same)} | {statistics.median(same_wall):.3f}"
        else:
            vs_hf = " | | "
        ratio = "1" if t is base else f"{statistics.median(cpu):.3f}"
        spread = "" if t is base else _range(cpu)
        wall_ratio = "1" if t is base else f"{statistics.median(wall):.3f}"
        rows.append(
            f"| {precision} | {t.label} | {what} | {1e3 * t.median_s('cpu'):.0f} | {ratio} | {spread} | "
            f"{wall_ratio} | {vs_hf} |"
        )
    copies = round_ratios(entries[1][0], base, "cpu")
    noise = _noise(copies)
    nothing = round_ratios(entries[2][0], base, "cpu")
    verdicts = {f"{precision}: nothing-plan within 1 % of no library": _verdict(nothing, NOTHING_PLAN, noise)}
    notes = [
        f"{name}, {precision}: {repeats} rounds x {steps} timed steps; the 2nd copy of no library steps "
        f"x{statistics.median(copies):.3f} of the first (rounds {_range(copies)}: noise {100 * noise:.1f} %, "
        f"the larger of its distance from 1 and half its interquartile range); nothing-plan "
        f"x{statistics.median(nothing):.3f} (rounds {_range(nothing)}); `handle.step(batch)` alone "
        f"{1e6 * handle_s:.0f} us, {100 * handle_s / base.median_s('cpu'):.3f} % of a step"
    ]
    for k, (ours, hf) in pairs.items():
        same = round_ratios(ours, hf, "cpu")
        verdicts[f"{precision}: ours on HF's layers (every_n_layers={k}) within 2 % of HF"] = _verdict(
            same, SAME_PLAN, noise
        )
        notes.append(
            f"  every_n_layers={k}: ours / HF x{statistics.median(same):.3f} (rounds {_range(same)}; wall clock "
            f"x{statistics.median(round_ratios(ours, hf, 'wall')):.3f})"
        )
    return rows, notes, verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and 2 rounds: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds (default 8; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per visit (default 2; quick 1)")
    parser.add_argument(
        "--precision", choices=("both", "bf16-mixed", "fp32"), default="both", help="which precision(s) to time"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 8)
    steps = args.steps or (1 if args.quick else 2)
    warnings.filterwarnings("ignore", module="transformers")
    torch.set_num_threads(1)
    print(
        f"lightning-ckpt per-step cost: torch {torch.__version__}, {torch.get_num_threads()} thread(s) "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), {platform.machine()} CPU, "
        f"{os.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at start, AdamW, "
        f"{'quick' if args.quick else 'full'} run"
    )
    precisions = {"both": (True, False), "bf16-mixed": (True,), "fp32": (False,)}[args.precision]
    rows, notes, verdicts = [], [], {}
    for bf16 in precisions:
        r, n, v = run(args.quick, bf16, repeats, steps)
        rows, notes, verdicts = rows + r, notes + n, {**verdicts, **v}
    print()
    print(
        "| precision | setting | checkpointed | step ms (CPU) | x no library | rounds | x no library (wall) | "
        "ours / HF, same layers | rounds | ours / HF (wall) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("\n".join(notes))
    if args.quick:
        print("(a quick run: its few short rounds make the verdicts below a smoke test, not a measurement)")
    for claim, verdict in verdicts.items():
        print(f"{claim}: {verdict}")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
