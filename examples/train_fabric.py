"""Train the 48-block encoder of `train_encoder.py` with Lightning Fabric and `auto_checkpoint`.

    OMP_NUM_THREADS=1 python examples/train_fabric.py --steps 20 --memory-budget 300MiB
    OMP_NUM_THREADS=1 python examples/train_fabric.py --devices 2 --strategy ddp   # two CPU processes

`auto_checkpoint` is called after `fabric.setup(model, optimizer)` on the module Fabric returns:
block paths are those of your own module (`blocks`), Fabric's wrapper and DDP are seen through,
and with several processes rank 0 plans and every rank applies its plan. Profiling runs inside
DDP's `no_sync`, so no gradient is reduced until the loop's own steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.train_encoder import EncoderClassifier, SyntheticTextDataModule  # noqa: E402
from lightning_ckpt import auto_checkpoint  # noqa: E402


def train(fabric: Fabric, steps: int, memory_budget: str, batch_size: int, n_blocks: int) -> list[float]:
    fabric.seed_everything(1234)
    model = EncoderClassifier(n_blocks=n_blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    data = SyntheticTextDataModule(batch_size=batch_size, n_train=steps * batch_size * fabric.world_size)
    data.setup()
    loader = fabric.setup_dataloaders(DataLoader(data.train_set, batch_size=batch_size, shuffle=False))

    def step_fn(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    losses = []
    with auto_checkpoint(
        model, memory_budget, example_batch=next(iter(loader)), step_fn=step_fn, optimizer=optimizer,
        blocks="blocks", info=fabric.print,
    ) as handle:
        model.train()
        for i, batch in enumerate(loader):
            handle.step(batch)
            loss = step_fn(batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            fabric.print(f"step {i}: loss {loss.item():.4f}")
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--memory-budget", default="300MiB", help="per-device peak for the whole step")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--n-blocks", type=int, default=48)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    args = parser.parse_args(argv)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy)
    fabric.launch()
    train(fabric, args.steps, args.memory_budget, args.batch_size, args.n_blocks)


if __name__ == "__main__":
    main()
