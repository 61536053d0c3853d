"""Models we did not write, under `auto_checkpoint`: predicted against measured whole-step peak.

    OMP_NUM_THREADS=1 python benchmarks/zoo.py            # the zoo at its benchmark sizes (~3 min)
    OMP_NUM_THREADS=1 python benchmarks/zoo.py --quick    # the sizes the tests use (~1 min)

Each model (HF T5 with the decoder's blocks and with both stacks as one chain, BERT, Llama, a
peft-LoRA Llama, ViT, ALBERT (one layer called at every depth: a block per call), Swin and ConvNeXt (the
blocks inside their stages); diffusers' UNet2DModel down/mid/up; MONAI's ResNet; a two-view contrastive
encoder written here, each block called twice a step) is built from a config with
its library's defaults (T5 and Llama keep `use_cache=True`; `auto_checkpoint` turns it off for the run
and back on after), with random weights, fp32 and dropout on, and trained a few AdamW steps at batch 8
twice: without checkpointing and under `auto_checkpoint` (`cost_metric="flops"`, so that the plan does
not depend on measured rates), at budgets a quarter and half of the way from the `full` peak up to the
`none` peak. Measured is the largest whole-step peak the live-storage tracker saw (parameters,
gradients, optimizer state, batch, activations); `growth` is the last step's peak minus the second's;
`same` compares every loss bit for bit. The rows come from `tests/zoo_check.py`, which the tests use.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo_models  # noqa: E402
from zoo_check import check  # noqa: E402

SIZES = {  # the benchmark's sizes; --quick uses the builders' defaults (those of the tests)
    "t5": {"layers": 6, "d_model": 64, "seq": 64},
    "bert": {"layers": 8, "hidden": 64, "seq": 64},
    "llama": {"layers": 8, "hidden": 64, "seq": 64},
    "lora_llama": {"layers": 8, "hidden": 64, "seq": 64},
    "vit": {"layers": 8, "hidden": 64, "image": 64},
    "unet": {"sample": 32, "channels": (32, 64)},
    "resnet": {"image": 64},
    "albert": {"layers": 8, "hidden": 64, "seq": 64},
    "swin": {"image": 64, "embed": 32},
    "convnext": {"image": 64, "widths": (16, 32, 32, 64)},
    "two_views": {"layers": 8, "hidden": 64, "seq": 64},
}


def builder(name: str, quick: bool):
    base = "t5" if name == "t5_both" else name
    sizes = {} if quick else SIZES[base]

    def build():
        entry = getattr(zoo_models, base)(**sizes)
        if name == "t5_both":
            entry.chain = ["encoder.block.*", "decoder.block.*"]
            entry.name = "t5_both"
        return entry

    return build


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    names = ["t5", "t5_both", "bert", "llama", "lora_llama", "vit", "unet", "resnet", "albert", "swin", "convnext",
             "two_views"]
    print("| model | budget | checkpointed | predicted | measured | predicted - measured | within budget | losses same | growth |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for share in (0.5, 0.25):
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = check(builder(name, args.quick), share, batch_size=8, steps=args.steps, cost_metric="flops")
            mib = 2**20
            print(
                f"| {name} | {row.budget_bytes / mib:.2f} MiB ({int(share * 100)} %) | {row.plan} | "
                f"{row.predicted_bytes / mib:.2f} MiB | {row.measured_bytes / mib:.2f} MiB | {100 * row.miss:+.1f} % | "
                f"{'yes' if row.fits else 'NO'} | {'yes' if row.losses_same else 'NO'} | {row.growth_bytes} B |",
                flush=True,
            )
            print(f"<!-- {name} {share}: {time.perf_counter() - t0:.1f} s -->", file=sys.stderr)


if __name__ == "__main__":
    main()
