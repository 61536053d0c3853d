"""Small LightningModules and data for callback tests."""

from __future__ import annotations

import tempfile

import lightning.pytorch as pl
import torch
from models import TinyChain
from torch.utils.data import DataLoader, TensorDataset


class LitChain(pl.LightningModule):
    def __init__(self, n_blocks: int = 6, d: int = 32, p: float = 0.1, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyChain(n_blocks=n_blocks, d=d, vocab=50, n_classes=3, p=p)
        self.losses: list[torch.Tensor] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())
        self.last_grads = {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TokenData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4, n: int = 64, seq: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 50, (n, seq), generator=g)
        y = (x[:, 0] % 3).long()
        self.ds = TensorDataset(x, y)

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=False)


def make_trainer(callbacks=(), max_steps: int = 3, **kw) -> pl.Trainer:
    kw.setdefault("default_root_dir", tempfile.mkdtemp(prefix="lckpt-"))
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )


class LitLazyChain(LitChain):
    """`LitChain` whose network is built in `configure_model`, as Lightning recommends for sharded
    training: before that hook (in `setup`) the module has no blocks."""

    def __init__(self, n_blocks: int = 6, d: int = 32, p: float = 0.1, lr: float = 0.05) -> None:
        super(LitChain, self).__init__()  # LightningModule's: no network here
        self.save_hyperparameters()
        self.net: TinyChain | None = None
        self.losses = []

    def configure_model(self) -> None:
        if self.net is None:  # Lightning may call it again (e.g. a second fit)
            h = self.hparams
            self.net = TinyChain(n_blocks=h.n_blocks, d=h.d, vocab=50, n_classes=3, p=h.p)
