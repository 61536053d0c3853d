"""Train the 48-block encoder of `train_encoder.py` in a plain PyTorch loop, with `auto_checkpoint`.

    OMP_NUM_THREADS=1 python examples/train_plain.py --steps 20 --memory-budget 300MiB

No Trainer: the loop below is what you would write anyway. One call before it,

    handle = auto_checkpoint(model, budget, example_batch=batch, step_fn=step_fn, optimizer=opt)

profiles `step_fn` on slices of the example batch, plans which blocks to recompute so that a step
fits the budget with the least recompute, and applies the plan; `handle.step(batch)` at the top of
each step plans a batch of a new shape before it runs (cached afterwards, nothing to do here: the
batches all have one shape). `step_fn` returns the loss; the loop runs its backward as usual.
`--compare` runs the same loop without `auto_checkpoint` after it and prints whether the losses match.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.train_encoder import EncoderClassifier, SyntheticTextDataModule  # noqa: E402
from lightning_ckpt import auto_checkpoint  # noqa: E402


def train(steps: int, memory_budget: str | None, batch_size: int, n_blocks: int, seed: int = 1234) -> list[float]:
    """`steps` AdamW steps of the encoder; with `memory_budget`, under auto_checkpoint. -> the losses."""
    torch.manual_seed(seed)
    model = EncoderClassifier(n_blocks=n_blocks)  # an nn.Module: its Lightning hooks are not used here
    data = SyntheticTextDataModule(batch_size=batch_size, n_train=steps * batch_size)
    data.setup()
    loader = DataLoader(data.train_set, batch_size=batch_size, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)

    def step_fn(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    example = next(iter(loader))  # (a new loader iterator draws its seed from torch's RNG: drawn in both runs)
    handle = None
    if memory_budget is not None:
        handle = auto_checkpoint(
            model, memory_budget, example_batch=example, step_fn=step_fn, optimizer=optimizer, blocks="blocks"
        )
    losses = []
    model.train()
    for i, batch in enumerate(loader):
        if handle is not None:
            handle.step(batch)
        loss = step_fn(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {i}: loss {loss.item():.4f}")
    if handle is not None:
        handle.remove()
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--memory-budget", default="300MiB", help="per-device peak for the whole step")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--n-blocks", type=int, default=48)
    parser.add_argument("--compare", action="store_true", help="also train without checkpointing and compare")
    args = parser.parse_args(argv)
    losses = train(args.steps, args.memory_budget, args.batch_size, args.n_blocks)
    if args.compare:
        plain = train(args.steps, None, args.batch_size, args.n_blocks)
        print("losses bit-identical to the loop without auto_checkpoint:", losses == plain)


if __name__ == "__main__":
    main()
