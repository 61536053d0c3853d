"""What the recompute's replay of a block's call costs: the state guard and the hook order.

    OMP_NUM_THREADS=1 python benchmarks/state_guard.py            # encoder and CNN, 8 rounds
    OMP_NUM_THREADS=1 python benchmarks/state_guard.py --quick    # smaller models, 4 rounds

For the 48-block encoder example (no module state written in its forward: the guard takes no
copy) and the ResNet-style CNN (BatchNorm in every block: its statistics are copied at each
checkpointed forward and replayed in the recompute), plan `optimal` at the budget half way
between the `full` and `none` peaks, then time, interleaved in one process (rounds in a rotating
order, one untimed step per visit, CPU clock): the plan applied with the state guard on (the
default, `guard_batchnorm=True`), the same plan with it off, and no plan at all (the user's
step without the library). Printed: each one's median step, guard on / guard off, and the
noise: the spread (max - min) of the per-round ratios of guard off to its own median.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import Case, step  # noqa: E402
from plans import case_budgets, cnn_case, encoder_case, profile_case  # noqa: E402

from lightning_ckpt import apply_segments, make_plan  # noqa: E402

VARIANTS = ("guard on", "guard off", "no plan")


def round_medians(case: Case, segments, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per variant, the median CPU seconds of a step in each round."""
    found: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        for variant in order:
            handle = None if variant == "no plan" else apply_segments(
                case.blocks, segments, guard_batchnorm=(variant == "guard on")
            )
            try:
                gc.collect()
                step(case)  # warm-up: hooks installed, the guard's first forward finds what is written
                times = []
                for _ in range(steps):
                    c0 = time.process_time()
                    step(case)
                    times.append(time.process_time() - c0)
                found[variant].append(statistics.median(times))
            finally:
                if handle is not None:
                    handle.remove()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 8)
    print("| model | checkpointed | guard on (s) | guard off (s) | no plan (s) | on / off | noise |")
    print("|---|---|---|---|---|---|---|")
    for build in (encoder_case, cnn_case):
        case = build(args.quick)
        cost = profile_case(case)
        budget = case_budgets(case, cost)["50 %"]
        plan = make_plan(cost, "optimal", budget)
        medians = round_medians(case, plan.segments, rounds, args.steps)
        on, off, bare = (statistics.median(medians[v]) for v in VARIANTS)
        ratios = [m / off for m in medians["guard off"]]
        print(
            f"| {case.name} | {len(plan.checkpointed)}/{len(case.blocks)} | {on:.3f} | {off:.3f} | {bare:.3f} | "
            f"x{on / off:.3f} | {max(ratios) - min(ratios):.1%} |"
        )


if __name__ == "__main__":
    main()
