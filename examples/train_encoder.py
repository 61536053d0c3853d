"""Train a 48-block transformer text encoder with automatic activation checkpointing.

    python examples/train_encoder.py fit --config configs/encoder48.yaml

One file, read top to bottom: the task (a synthetic text classification set made
from a fixed seed, so nothing is downloaded), the model (token + position
embedding, a chain of 48 hand-written pre-norm transformer blocks, mean pooling,
a linear head), and `main()`, which hands both to `LightningCLI`. The YAML config
adds `lightning_ckpt.ActivationCheckpointing` under `trainer.callbacks`: at the
start of fit it profiles the blocks, plans which ones to recompute so that a
step at `target_batch_size` fits `memory_budget`, and applies that plan.

The checkpointing library needs one thing from the model: an ordered container
of blocks that is run as a plain chain,

    for block in self.blocks:
        x = block(x)

each block taking one tensor (batch, seq, d_model) and returning one of the same
shape. Everything else here is an ordinary LightningModule.

The task. Each sequence is filler tokens with some "keyword" tokens planted in it;
the vocabulary holds `n_classes` disjoint groups of keywords, and the label is the
group whose keywords occur most often. Every group is planted 2 to 8 times and the
winner 1 to 12 times more than the runner-up, so the model must count, not just
spot a keyword. Mean pooling over the sequence turns counts into a linear feature,
so a model that carries token identity through the blocks learns it within a
hundred steps; chance is 1 / n_classes (25 %).

Without a config file, name the classes; the defaults below (the same numbers as
the YAML) apply, with Lightning's trainer defaults and no checkpointing callback:

    python examples/train_encoder.py fit --model=examples.train_encoder.EncoderClassifier \
        --data=examples.train_encoder.SyntheticTextDataModule --trainer.max_steps=100

To see the plan without training: python -m lightning_ckpt plan --config configs/encoder48.yaml
"""

from __future__ import annotations

import math
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
# Data: a learnable text classification task generated from a fixed seed.


def make_keyword_count_task(
    n_samples: int,
    seq_len: int,
    vocab_size: int,
    n_classes: int,
    keywords_per_class: int,
    generator: torch.Generator,
    min_plants: int = 2,
    max_plants: int = 8,
    max_margin: int = 12,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n_samples` sequences of `seq_len` token ids and their labels.

    Token ids `[0, n_classes * keywords_per_class)` are keywords, class `c` owning
    `[c * keywords_per_class, (c + 1) * keywords_per_class)`; the rest are filler.
    Every class gets between `min_plants` and `max_plants` keyword occurrences
    (keywords drawn at random within its group) at random positions; the label's
    class gets `1..max_margin` more than the most of any other class, so the label
    is the unique argmax of the per-class keyword counts.
    """
    n_keywords = n_classes * keywords_per_class
    if n_keywords >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} leaves no filler tokens after {n_keywords} keywords")
    max_total = (n_classes - 1) * max_plants + max_plants + max_margin
    if max_total > seq_len:
        raise ValueError(f"seq_len={seq_len} is too short for up to {max_total} planted keywords")
    g = generator
    x = torch.randint(n_keywords, vocab_size, (n_samples, seq_len), generator=g)
    y = torch.randint(0, n_classes, (n_samples,), generator=g)
    counts = torch.randint(min_plants, max_plants + 1, (n_samples, n_classes), generator=g)
    others_max = counts.masked_fill(F.one_hot(y, n_classes).bool(), -1).amax(dim=1)
    margin = torch.randint(1, max_margin + 1, (n_samples,), generator=g)
    counts[torch.arange(n_samples), y] = others_max + margin
    for i in range(n_samples):
        # Distinct positions for all planted keywords of this sequence.
        total = int(counts[i].sum())
        pos = torch.randperm(seq_len, generator=g)[:total]
        cls = torch.repeat_interleave(torch.arange(n_classes), counts[i])
        word = torch.randint(0, keywords_per_class, (total,), generator=g)
        x[i, pos] = cls * keywords_per_class + word
    return x, y


class SyntheticTextDataModule(LightningDataModule):
    """Train/val splits of the keyword-count task, made from `seed` (no download).

    `batch_size` is a public attribute read every time a loader is built, so the
    checkpointing callback can change it (as Lightning's BatchSizeFinder does,
    through `lightning_setattr(model, "batch_size", n)`) and reload the loaders.
    """

    def __init__(
        self,
        # The target batch of the example; the callback may change it (see above).
        batch_size: int = 16,
        # Long enough that the (batch, heads, seq, seq) attention maps are a large share
        # of the activations, short enough for a step of ~2 s on one CPU thread.
        seq_len: int = 128,
        # 16 keyword tokens (4 classes x 4) and ~500 filler tokens.
        vocab_size: int = 512,
        # Chance accuracy is 1 / n_classes = 25 %.
        n_classes: int = 4,
        # Few keywords per class: each is seen often, so its embedding is learned fast.
        keywords_per_class: int = 4,
        # Every class's keywords occur 2..8 times in a sequence (at most 44 of 128
        # tokens are keywords) and the label's class 1..12 times more than the
        # runner-up: the wide margins are learned in tens of steps, the narrow ones
        # keep it from being trivial (with 2..6 plants and margins of only 1..3, a
        # 4-block model was still under 50 % after 200 steps).
        min_plants: int = 2,
        max_plants: int = 8,
        max_margin: int = 12,
        # 512 steps of 16: more than a few-minute run sees, so no sample repeats.
        n_train: int = 8192,
        # 512 held-out sequences; the config validates on the first 128 of them.
        n_val: int = 512,
        # The data set and its shuffling are a function of this seed alone.
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.n_classes = n_classes
        self.keywords_per_class = keywords_per_class
        self.min_plants = min_plants
        self.max_plants = max_plants
        self.max_margin = max_margin
        self.n_train = n_train
        self.n_val = n_val
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def _make(self, n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x, y = make_keyword_count_task(
            n, self.seq_len, self.vocab_size, self.n_classes, self.keywords_per_class, g,
            min_plants=self.min_plants, max_plants=self.max_plants, max_margin=self.max_margin,
        )
        return TensorDataset(x, y)

    def setup(self, stage: str | None = None) -> None:
        # Separate generator streams so the val set does not depend on n_train.
        if self.train_set is None:
            self.train_set = self._make(self.n_train, self.seed)
        if self.val_set is None:
            self.val_set = self._make(self.n_val, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        # Shuffle order from its own seeded generator: reruns see the same batches.
        g = torch.Generator().manual_seed(self.seed + 2)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, generator=g, num_workers=0, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=0)


# ----------------------------------------------------------------------------------
# Model: a pre-norm transformer encoder written out by hand.


class SelfAttention(nn.Module):
    """Multi-head self-attention with the softmax spelled out.

    Not `F.scaled_dot_product_attention` or `nn.MultiheadAttention`: every matmul,
    the softmax and the dropout are plain ops, so FLOP counting and the accounting
    of what is saved for backward see exactly what runs.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)  # (b, h, t, d/h)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))  # (b, h, t, t)
        att = self.attn_drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class EncoderBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x)). One tensor in, one out."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        x = x + self.drop2(self.proj(F.gelu(self.fc(self.ln2(x)))))
        return x


class EncoderClassifier(LightningModule):
    """Token + position embedding -> `n_blocks` EncoderBlocks -> LayerNorm -> mean pool -> linear head."""

    def __init__(
        self,
        # Deep enough that keeping every block's activations is what limits the batch
        # size: the case activation checkpointing is for.
        n_blocks: int = 48,
        # Narrow, so one step of the 48-block stack at batch 16 takes ~2 s on one CPU
        # thread (135 GFLOP) and the whole example runs in a few minutes.
        d_model: int = 128,
        # 32-wide heads: few enough that attention stays cheap, more than one so the
        # blocks can attend to several keyword groups at once.
        n_heads: int = 4,
        # Must equal the data's seq_len (the learned position table has this many rows).
        # 128 tokens make the (b, h, t, t) attention maps a visible share of the memory.
        seq_len: int = 128,
        # Must cover the data's vocabulary (4 classes x 4 keywords + filler).
        vocab_size: int = 512,
        # Chance accuracy is 1 / n_classes = 25 %.
        n_classes: int = 4,
        # Dropout on attention weights and both residual branches: makes the steps
        # random, which the checkpointing must reproduce exactly on recompute.
        dropout: float = 0.1,
        # AdamW at 3e-4 after a short warmup: the 48-block model reaches ~80 % in 80
        # steps; at 1e-3 it stalled near 65 % (Adam moves every block weight by about
        # lr per step, and at 1e-3 the 48 blocks soon drown the token signal).
        lr: float = 3e-4,
        # Mild decoupled weight decay on matrices only (not on norms, biases, embeddings).
        weight_decay: float = 0.01,
        # Linear warmup: the first Adam steps on a 48-deep stack are the unstable ones.
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Parameter(torch.zeros(1, seq_len, d_model))
        self.emb_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([EncoderBlock(d_model, n_heads, dropout) for _ in range(n_blocks)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)
        self._init_weights(n_blocks)
        # Lets Lightning's model summary show per-layer shapes and FLOPs.
        self.example_input_array = torch.zeros(1, seq_len, dtype=torch.long)
        self.train_acc = MulticlassAccuracy(num_classes=n_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=n_classes, average="micro")

    def _init_weights(self, n_blocks: int) -> None:
        # GPT-2 style: linear layers N(0, 0.02), and the two output projections that
        # add into the residual stream scaled by 1/sqrt(2 * n_blocks), so the stream
        # does not grow with depth and each block starts close to the identity.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_blocks))
        # Token embedding N(0, 1) (PyTorch's default), not GPT-2's 0.02: token identity
        # then dominates the residual stream at init, above what 48 freshly updated
        # blocks add, so the pooled features carry the keyword counts from step 0 and
        # accuracy leaves chance within the first tens of steps (with 0.02 the 48-block
        # stack sat at chance for 40+ steps). Positions stay small: they carry no label.
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.pos_emb, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.emb_drop(self.tok_emb(idx) + self.pos_emb[:, :t])
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x).mean(dim=1)  # mean pooling over the sequence
        return self.head(x)

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
        def decays(name: str, p: nn.Parameter) -> bool:
            return p.dim() >= 2 and not name.startswith(("tok_emb", "pos_emb"))

        decay = [p for n, p in self.named_parameters() if decays(n, p)]
        no_decay = [p for n, p in self.named_parameters() if not decays(n, p)]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
        )
        warmup = max(1, self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ----------------------------------------------------------------------------------


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Run LightningCLI; `args` as on the command line (None reads sys.argv).

    The config names the classes (`model: class_path: examples.train_encoder.EncoderClassifier`),
    so the same YAML also drives `python -m lightning_ckpt plan --config ...`. With
    `run=False` the config is parsed and the trainer, model and datamodule are built
    but nothing runs (then `args` has no subcommand such as `fit`).
    """
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # `examples.train_encoder` must import when run as a script
        sys.path.insert(0, root)
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
    main()
