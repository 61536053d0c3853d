"""Train a small ResNet on synthetic shapes with automatic activation checkpointing.

    python examples/train_cnn.py fit --config configs/cnn.yaml

One file, read top to bottom: the task (coloured shapes drawn on noisy 32x32
images from a fixed seed, so nothing is downloaded), the model (a stem and four
stages of residual blocks with BatchNorm at falling resolution, 32x32 -> 16x16 ->
8x8 -> 4x4 with channels rising 16 -> 32 -> 64 -> 128, then global average
pooling and a linear head), and `main()`, which hands both to `LightningCLI`.

Why this model. Unlike the transformer encoder's identical blocks, these blocks
are not alike: every stage halves the resolution and doubles the channels, so
each block costs about the same FLOPs, but a block at 32x32 keeps 4x the bytes of
one at 8x8 and 8x those of one at 4x4. Bytes freed per FLOP recomputed is highest
early, so the planner should checkpoint the high-resolution stages first and keep
the cheap-to-store late ones. The config lists the chain of blocks as paths

    blocks: ["stem", "layer1.*", "layer2.*", "layer3.*", "layer4.*"]

and each block's input is a natural narrow point (a residual stream between
blocks; a stage's first block takes the previous stage's smaller-channel output).
The forward calls them in that order, each on the previous one's output, so
consecutive blocks can share one checkpointed segment.

BatchNorm is the reason this example exists next to the encoder: a recompute
reruns the forward in training mode, which would update the running statistics
a second time. lightning-ckpt restores them around each recompute, so training
with checkpointing leaves exactly the statistics training without it leaves.

The task: each image shows one of `n_classes` shapes (horizontal bar, vertical
bar, disk, ring, then plus, square, triangle, diamond) at a random position and
size, in a random colour on a random background colour, with pixel noise. The
label is the shape, so colour and position must be ignored; chance is 1 / n_classes.

Run from the repository root (the config names the classes as
`examples.train_cnn.*`). Without a config file, give the classes yourself:

    python examples/train_cnn.py fit --model examples.train_cnn.ShapesResNet \\
        --data examples.train_cnn.ShapesDataModule --trainer.max_steps=200
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

# ----------------------------------------------------------------------------------
# Data: shapes drawn on noisy images from a fixed seed.

# Each shape is a mask over pixel offsets (dx, dy) from its centre, in units of its radius.
_MASKS = {
    "disk": lambda dx, dy: dx**2 + dy**2 <= 1.0,
    "square": lambda dx, dy: (dx.abs() <= 0.8) & (dy.abs() <= 0.8),
    "triangle": lambda dx, dy: (dy >= -0.9) & (dy <= 0.8) & (dx.abs() <= (dy + 0.9) * 0.55),  # apex up
    "plus": lambda dx, dy: ((dx.abs() <= 0.3) & (dy.abs() <= 1.0)) | ((dy.abs() <= 0.3) & (dx.abs() <= 1.0)),
    "ring": lambda dx, dy: (dx**2 + dy**2 <= 1.0) & (dx**2 + dy**2 >= 0.4),
    "hbar": lambda dx, dy: (dx.abs() <= 1.0) & (dy.abs() <= 0.35),
    "vbar": lambda dx, dy: (dy.abs() <= 1.0) & (dx.abs() <= 0.35),
    "diamond": lambda dx, dy: dx.abs() + dy.abs() <= 1.0,
}
# Classes are the first `n_classes` of these. Bars of two orientations, a disk and
# a ring first: with random colours and positions a small net tells these four
# apart within ~100 steps (disk / square / triangle / plus took 2-3x longer).
SHAPES = ("hbar", "vbar", "disk", "ring", "plus", "square", "triangle", "diamond")


def draw_shapes(
    n_samples: int,
    image_size: int,
    n_classes: int,
    generator: torch.Generator,
    noise: float = 0.1,
    min_radius: float = 6.0,
    max_radius: float = 11.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n_samples` images (n, 3, image_size, image_size) and their shape labels.

    Each shape is a mask over pixel offsets (dx, dy) from a random centre, scaled
    by a random radius; the foreground colour differs from the background by at
    least 0.35 on average over the channels, so every shape stays visible.
    """
    if not 2 <= n_classes <= len(SHAPES):
        raise ValueError(f"n_classes={n_classes} must be between 2 and {len(SHAPES)} (the shapes: {', '.join(SHAPES)}).")
    if image_size < 2 * max_radius + 2:
        raise ValueError(f"image_size={image_size} is too small for shapes of radius up to {max_radius}.")
    g = generator
    y = torch.randint(0, n_classes, (n_samples,), generator=g)
    r = min_radius + (max_radius - min_radius) * torch.rand(n_samples, 1, 1, generator=g)
    # Centres keep the whole shape inside the image.
    lo, span = r + 0.5, image_size - 1 - 2 * (r + 0.5)
    cx = lo + span * torch.rand(n_samples, 1, 1, generator=g)
    cy = lo + span * torch.rand(n_samples, 1, 1, generator=g)
    coords = torch.arange(image_size, dtype=torch.float32)
    dx = (coords.view(1, 1, -1) - cx) / r  # offsets in units of the radius
    dy = (coords.view(1, -1, 1) - cy) / r
    masks = torch.stack([_MASKS[name](dx, dy) for name in SHAPES[:n_classes]], dim=1)  # (n, n_classes, H, W)
    mask = masks[torch.arange(n_samples), y].unsqueeze(1).float()  # (n, 1, H, W)
    bg = torch.rand(n_samples, 3, 1, 1, generator=g)
    fg = torch.rand(n_samples, 3, 1, 1, generator=g)
    # Push the foreground away from the background where they are too alike.
    diff = fg - bg
    weak = diff.abs().mean(dim=1, keepdim=True) < 0.35
    fg = torch.where(weak, (bg + 0.5 * torch.sign(diff + 1e-6)).clamp(0, 1), fg)
    fg = torch.where(weak & ((fg - bg).abs().mean(dim=1, keepdim=True) < 0.35), 1 - bg, fg)
    img = bg + mask * (fg - bg)
    img = img + noise * torch.randn(img.shape, generator=g)
    return (img - 0.5) / 0.3, y  # roughly zero mean, unit variance


class ShapesDataModule(LightningDataModule):
    """Train/val splits of the shapes task, made from `seed` (no download).

    `batch_size` is a public attribute read every time a loader is built, so the
    checkpointing callback can set it to `target_batch_size` and reload the loaders.
    """

    def __init__(
        self,
        # The config's target batch; the callback sets this to its target_batch_size.
        batch_size: int = 64,
        # CIFAR-sized: four stages halve it to 16, 8 and 4.
        image_size: int = 32,
        # Horizontal bar, vertical bar, disk, ring: chance is 25 %.
        n_classes: int = 4,
        # Pixel noise (in [0, 1] colour units) so the task is not a lookup.
        noise: float = 0.1,
        # Shape radii in pixels: at 6-11 px the four shapes differ in enough pixels
        # that val accuracy passes 90 % within 100 steps (at 4-9 px the net had not
        # left chance after 150 steps).
        min_radius: float = 6.0,
        max_radius: float = 11.0,
        # 200 steps x 64 = 12800 samples: a little over one pass over the training set.
        n_train: int = 12288,
        n_val: int = 1024,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.image_size = image_size
        self.n_classes = n_classes
        self.noise = noise
        self.min_radius = min_radius
        self.max_radius = max_radius
        self.n_train = n_train
        self.n_val = n_val
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def _make(self, n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        return TensorDataset(*draw_shapes(
            n, self.image_size, self.n_classes, g, noise=self.noise, min_radius=self.min_radius, max_radius=self.max_radius
        ))

    def setup(self, stage: str | None = None) -> None:
        # Separate seeds so the val set does not depend on n_train.
        if self.train_set is None:
            self.train_set = self._make(self.n_train, self.seed)
        if self.val_set is None:
            self.val_set = self._make(self.n_val, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        g = torch.Generator().manual_seed(self.seed + 2)  # reruns see the same batches
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=g, num_workers=0, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=0)


# ----------------------------------------------------------------------------------
# Model: a small ResNet, written out.


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a shortcut, then relu (ResNet's basic block).

    With `stride=2` the block halves the resolution and its shortcut is a strided
    1x1 conv with BatchNorm to match the new channel count. One tensor in, one out.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def _stage(c_in: int, c_out: int, n_blocks: int, stride: int) -> nn.Sequential:
    return nn.Sequential(BasicBlock(c_in, c_out, stride), *(BasicBlock(c_out, c_out) for _ in range(n_blocks - 1)))


class ShapesResNet(LightningModule):
    def __init__(
        self,
        # Chance accuracy is 1 / n_classes; must equal the data's n_classes.
        n_classes: int = 4,
        # Channels of the stem and stage 1; stages 2-4 double it each time (16, 32,
        # 64, 128). Each block then costs about the same FLOPs while a stage-1 block
        # holds 4x the activation bytes of a stage-3 block: the non-uniform case.
        width: int = 16,
        # Two basic blocks per stage, as in ResNet-18: 9 blocks in the chain with the
        # stem, and one 200-step run takes about a minute on one CPU thread.
        blocks_per_stage: int = 2,
        # AdamW at 2e-3: BatchNorm keeps this small net stable at a high rate; train
        # accuracy passes 80 % within ~30 steps.
        lr: float = 2e-3,
        # Mild decoupled weight decay on conv and linear weights only.
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.layer1 = _stage(w, w, blocks_per_stage, stride=1)  # 32x32
        self.layer2 = _stage(w, 2 * w, blocks_per_stage, stride=2)  # 16x16
        self.layer3 = _stage(2 * w, 4 * w, blocks_per_stage, stride=2)  # 8x8
        self.layer4 = _stage(4 * w, 8 * w, blocks_per_stage, stride=2)  # 4x4
        self.head = nn.Linear(8 * w, n_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        self.train_acc = MulticlassAccuracy(num_classes=n_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=n_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One stage at a time, rebinding `x`: a nested call such as
        # layer4(layer3(layer2(layer1(x)))) would keep the stem's output referenced
        # by `x` until the last stage returns, alive even where it is checkpointed.
        x = self.stem(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        return self.head(x.mean(dim=(2, 3)))  # global average pooling

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]  # BatchNorm weights and biases
        return torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
        )


# ----------------------------------------------------------------------------------


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Run LightningCLI; `args` as on the command line (None reads sys.argv).

    Model and data are given by `class_path` (as in configs/cnn.yaml), the same
    way `python -m lightning_ckpt plan --config configs/cnn.yaml` reads them. With
    `run=False` the config is parsed and everything is built but nothing runs
    (then `args` has no subcommand such as `fit`).
    """
    return LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    # The config names `examples.train_cnn.ShapesResNet`: make the repository root
    # importable and run `main` from that module, so the classes built from the
    # config are the very ones defined here (not copies under `__main__`).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.train_cnn import main as _main

    _main()
