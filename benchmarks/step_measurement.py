"""What measuring a step costs: a planned training step with and without the first-step measurement.

    OMP_NUM_THREADS=1 python benchmarks/step_measurement.py            # encoder and CNN, 6 rounds
    OMP_NUM_THREADS=1 python benchmarks/step_measurement.py --quick    # smaller models, 4 rounds

The callback measures the first steady step of each batch shape (`measure_peak`, on by default). On CPU
it counts live tensors with `StepBytesTracker` (the model's state and the batch adopted) and reads the
kernel's RSS high-water mark, as `frontends.lightning.measured_peak.step_peak` runs it here. For the
encoder example and the ResNet-style CNN, plan `optimal` at the budget half way between the `full` and
`none` peaks and apply it, then time, interleaved in one process (rounds in a rotating order, one
untimed step per visit, CPU clock): the step without measurement, the step measured as the callback
measures it, and the step measured with the general `LiveBytesTracker` (which reads every op's inputs).
Printed: each one's median step, measured / plain (the measurement's cost is that ratio minus one step,
paid once per batch shape), the two trackers' peaks (they must agree) and the noise: the spread (max -
min) of the per-round ratios of the plain step to its own median.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _timing import Case, step  # noqa: E402
from plans import case_budgets, cnn_case, encoder_case, profile_case  # noqa: E402

from lightning_ckpt import apply_segments, make_plan  # noqa: E402
from lightning_ckpt.frontends.lightning.measured_peak import step_peak  # noqa: E402
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker, StepBytesTracker  # noqa: E402
from lightning_ckpt.units import format_bytes  # noqa: E402

VARIANTS = ("plain", "measured", "general tracker")
TRACKERS = {"measured": StepBytesTracker, "general tracker": LiveBytesTracker}


def measured_step(case: Case, variant: str) -> int | None:
    """One step, measured as the callback measures its first steady step (`variant`'s tracker); its peak."""
    if variant == "plain":
        step(case)
        return None
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), optimizers=[case.optimizer])
    with contextlib.ExitStack() as stack:
        reading = stack.enter_context(step_peak(trainer, case.model, case.batch, None, TRACKERS[variant]))
        step(case)
    return reading.peak_bytes


def round_medians(case: Case, rounds: int, steps: int) -> tuple[dict[str, list[float]], dict[str, int | None]]:
    """Per variant, the median CPU seconds of a step in each round, and the peak each measured."""
    found: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks: dict[str, int | None] = {}
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        for variant in order:
            gc.collect()
            step(case)  # warm-up: the optimizer state exists, the plan's hooks have run
            times = []
            for _ in range(steps):
                c0 = time.process_time()
                peaks[variant] = measured_step(case, variant)
                times.append(time.process_time() - c0)
            found[variant].append(statistics.median(times))
    return found, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per visit")
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 6)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(
        f"lightning-ckpt step-measurement benchmark: torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start, {rounds} rounds x {args.steps} steps\n"
    )
    print("| model | checkpointed | plain step (s) | measured (s) | measured / plain | general tracker (s) "
          "| general / plain | peak (measured) | peak (general) | noise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for build in (encoder_case, cnn_case):
        case = build(args.quick)
        cost = profile_case(case)
        plan = make_plan(cost, "optimal", case_budgets(case, cost)["50 %"])
        handle = apply_segments(case.blocks, plan.segments, inner_segments=plan.inner_segments)
        try:
            medians, peaks = round_medians(case, rounds, args.steps)
        finally:
            handle.remove()
        plain, measured, general = (statistics.median(medians[v]) for v in VARIANTS)
        ratios = [m / plain for m in medians["plain"]]
        print(
            f"| {case.name} | {len(plan.checkpointed)}/{len(case.blocks)} | {plain:.3f} | {measured:.3f} | "
            f"x{measured / plain:.2f} | {general:.3f} | x{general / plain:.2f} | {format_bytes(peaks['measured'])} | "
            f"{format_bytes(peaks['general tracker'])} | {max(ratios) - min(ratios):.1%} |"
        )


if __name__ == "__main__":
    main()
