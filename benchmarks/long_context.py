"""One long sequence per step: HF Llama (from config, 4 layers, hidden 64, `use_cache` as it ships) at
batch (1, L), a budget 30 % of the way from the `full` plan's peak to the `none` one's at each length.
For each length, `auto_checkpoint` and the Lightning callback (`target_batch_size=1`) are run: profiling's
peak measured by glibc's heap count around the call (`tests/malloc_oracle.py`), the plan's prediction,
each step's measured peak, losses against training without the library, and the longest length that
fits at batch 1 from the profiles alone.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py [--lengths 512 1024 2048]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples"), str(ROOT)]
os.environ.setdefault("LIGHTNING_CKPT_CACHE_DIR", tempfile.mkdtemp(prefix="long-context-timings-"))

import torch  # noqa: E402

import test_long_context as lc  # noqa: E402
from test_profile_budget import _held, heap_peak  # noqa: E402

from lightning_ckpt import ActivationCheckpointing, auto_checkpoint  # noqa: E402

MiB = 2**20


def _callback_run(length: int, budget: int) -> tuple[list[int], bool, int]:
    from hf_models import CausalTokens, LitHF, StepPeaks
    from lit_models import make_trainer

    data = CausalTokens(batch_size=1, n=2, seq=length)
    plain, model, peaks = LitHF(lc._llama()), LitHF(lc._llama()), StepPeaks()
    make_trainer([], max_steps=2).fit(plain, datamodule=data)
    cb = ActivationCheckpointing(1, memory_budget=budget, blocks="model.model.layers", cost_metric="flops",
                                 verbose=False, report=False)
    make_trainer([cb, peaks], max_steps=2).fit(model, datamodule=data)
    same = len(model.losses) == 2 and all(torch.equal(a, b) for a, b in zip(model.losses, plain.losses))
    return peaks.peaks, same, len(cb.plan.checkpointed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(f"lightning-ckpt long-context benchmark: torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          "HF Llama 4 layers hidden 64, batch 1, budget 30 % from full to none")
    print("| length | budget | unplanned step | profiling peak (malloc) | x budget | costed from | checkpointed "
          "| predicted | steps measured | losses equal | callback steps | callback losses equal | longest that fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        batches = [lc._ids(length, seed) for seed in range(2)]
        budget = lc._budget(lc._llama(), batches[0], 0.3)
        ref_losses, ref_peaks = lc._train(lc._llama(), batches)
        model = lc._llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with heap_peak(_held(model, [opt], batches[0])) as found:
            handle = auto_checkpoint(model, budget, example_batch=batches[0], step_fn=lambda b: model(**b).loss,
                                     optimizer=opt, blocks=lc.BLOCKS, cost_metric="flops", verbose=False)
        decision = next(iter(handle.engine._shapes.plans.values()))
        losses, peaks = lc._train(model, batches, handle)
        longest = handle.longest_length()
        handle.remove()
        cb_peaks, cb_same, _ = _callback_run(length, budget)
        source = decision.source.split(" (")[0]
        mib = lambda b: f"{b / MiB:.1f} MiB"  # noqa: E731
        print(
            f"| {length} | {mib(budget)} | {mib(max(ref_peaks))} | {mib(found[0])} | {found[0] / budget:.2f} | {source} "
            f"| {len(handle.plan.checkpointed)}/{handle.plan.n_blocks} | {mib(handle.plan.predicted_peak_bytes)} "
            f"| {', '.join(mib(p) for p in peaks)} | {all(torch.equal(a, b) for a, b in zip(losses, ref_losses))} "
            f"| {', '.join(mib(p) for p in cb_peaks)} | {cb_same} | {longest} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
