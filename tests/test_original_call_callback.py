"""Through the Lightning callback: a model whose blocks write state in their forward and carry the
user's hooks trains bit-identically with and without `ActivationCheckpointing` (losses, parameters,
every buffer), with blocks checkpointed alone and in segments of several."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lit_models import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import ActivationCheckpointing

D, N_BLOCKS = 16, 6


class Block(nn.Module):
    """Spectral norm (its power iteration updates `weight_u`/`weight_v` in every training forward),
    a buffer counter used in the math, and a running mean rebound each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(D, D))
        self.old = nn.utils.spectral_norm(nn.Linear(D, D))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x):
        self.count += 1
        self.ema = self.ema * 0.9 + x.mean(0).detach() * 0.1
        h = torch.tanh(self.lin(x - self.ema)) * (1.0 + 0.01 * self.count)
        return x + F.gelu(self.old(h))


class Stateful(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.head = nn.Linear(D, 3)
        # the user's hooks: an input transform on one block, an output replacement on another
        self.blocks[1].register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
        self.blocks[3].register_forward_hook(lambda m, args, out: out + 1.0)
        self.losses: list[torch.Tensor] = []

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # the steps of the fit, not profiling's
        self.losses.append(outputs["loss"].detach().clone())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, D, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=8)


def _fit(callbacks) -> Stateful:
    model = Stateful()
    make_trainer(callbacks, max_steps=4).fit(model, train_dataloaders=_data())
    return model


@pytest.mark.parametrize(("policy", "every_k"), [("full", None), ("every_k", 2)])
def test_a_stateful_hooked_model_trains_bit_identically_under_the_callback(policy, every_k):
    plain = _fit([])
    cb = ActivationCheckpointing(
        target_batch_size=8, memory_budget="1GiB", policy=policy, every_k=every_k, blocks="blocks", verbose=False,
        report=False,
    )
    ckpt = _fit([cb])
    assert cb.plan is not None and len(cb.plan.checkpointed) == N_BLOCKS
    assert any(b > a for a, b in cb.plan.segments) == (policy == "every_k")  # segments of several blocks
    assert torch.equal(torch.stack(plain.losses), torch.stack(ckpt.losses))
    for (name, a), (_, b) in zip(plain.state_dict().items(), ckpt.state_dict().items(), strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name
    assert int(ckpt.blocks[0].count) == 4  # one forward per step: neither profiling nor a recompute counted
