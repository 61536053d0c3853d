"""Steps that run the blocks more than once, under the Lightning callback: a SimCLR-style step (one
encoder on two views), a `CombinedLoader` with a forward per loader, and a GAN trained by manual
optimization (two optimizers; the discriminator on the generator's images, on real ones and on fakes).
Each trains bit-identically to the same fit without the callback, every step's measured peak within
the budget, with a plan that checkpoints calls of more than one pass."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from hf_models import StepPeaks
from lightning.pytorch.utilities import CombinedLoader
from lit_models import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.planning.policies import make_plan

D, N_BLOCKS, BATCH, STEPS, SEQ = 32, 4, 8, 3, 16  # samples of SEQ tokens: activations outweigh parameters


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2, self.drop = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, d_in: int = D, d_out: int = D, pool: bool = True) -> None:
        super().__init__()
        self.pool = pool
        self.inp, self.blocks, self.out = nn.Linear(d_in, D), nn.ModuleList(Block() for _ in range(N_BLOCKS)), nn.Linear(D, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h).mean(1) if self.pool else self.out(h)


def _data(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SEQ, D, generator=g)
    return TensorDataset(x, (x[:, 0, 0] > 0).long())


class LitSimCLR(pl.LightningModule):
    """One encoder on two noisy views of each sample; a contrastive loss between them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        z1 = F.normalize(self.net(x + 0.1 * torch.randn_like(x)), dim=1)
        z2 = F.normalize(self.net(x + 0.1 * torch.randn_like(x)), dim=1)
        logits = z1 @ z2.T / 0.5
        loss = F.cross_entropy(logits, torch.arange(len(x)))
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=BATCH)


class LitTwoLoaders(LitSimCLR):
    """A `CombinedLoader` of two datasets: one forward of the same network per loader."""

    def training_step(self, batch, batch_idx):
        (xa, ya), (xb, yb) = batch["a"], batch["b"]
        loss = F.cross_entropy(self.net(xa)[:, :2], ya) + F.cross_entropy(self.net(xb)[:, :2], yb)
        self.losses.append(loss.detach().clone())
        return loss

    def train_dataloader(self):
        loaders = {"a": DataLoader(_data(seed=0), batch_size=BATCH), "b": DataLoader(_data(seed=1), batch_size=BATCH)}
        return CombinedLoader(loaders, mode="max_size_cycle")


class LitGAN(pl.LightningModule):
    """A GAN by manual optimization: the generator's step through the discriminator, then the
    discriminator's step on real and on generated samples, each optimizer toggled."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = Net(pool=False), Net(d_out=1)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(len(real), SEQ, D)
        self.toggle_optimizer(opt_g)
        fake = self.gen(z)
        g_loss = F.binary_cross_entropy_with_logits(self.disc(fake), torch.ones(len(real), 1))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = F.binary_cross_entropy_with_logits(self.disc(real), torch.ones(len(real), 1)) + \
            F.binary_cross_entropy_with_logits(self.disc(fake.detach()), torch.zeros(len(real), 1))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.losses += [g_loss.detach().clone(), d_loss.detach().clone()]

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(self.disc.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=BATCH)


CASES = {
    "simclr": (LitSimCLR, ["net.blocks.*"]),
    "two_loaders": (LitTwoLoaders, ["net.blocks.*"]),
    "gan": (LitGAN, ["gen.blocks.*", "disc.blocks.*"]),
}


def _fit(model, callbacks):
    trainer = make_trainer(callbacks, max_steps=STEPS)
    trainer.fit(model)
    return trainer


def _budget(cls, blocks) -> int:
    """5 % of the way from `full`'s predicted peak to `none`'s: most calls are checkpointed."""
    pl.seed_everything(0, verbose=False)
    probe = ActivationCheckpointing(BATCH, "1GiB", blocks=blocks, policy="none", verbose=False, report=False)
    _fit(cls(), [probe])
    full, none = (make_plan(probe.cost, p).predicted_peak_bytes for p in ("full", "none"))
    assert full < none
    return int(full + 0.05 * (none - full))


@pytest.mark.parametrize("case", list(CASES))
def test_several_passes_train_within_budget_bit_identically(case):
    cls, blocks = CASES[case]
    budget = _budget(cls, blocks)
    pl.seed_everything(0, verbose=False)
    reference = cls()
    _fit(reference, [])
    pl.seed_everything(0, verbose=False)
    model, peaks = cls(), StepPeaks()
    # planned by FLOPs: which calls are checkpointed rests on no measured time
    cb = ActivationCheckpointing(BATCH, budget, blocks=blocks, verbose=False, report=False, cost_metric="flops")
    _fit(model, [cb, peaks])

    names = [r.name for r in cb.plan.rows]
    chosen = {names[i] for i in cb.plan.checkpointed}
    if case == "gan":  # the discriminator's call in the generator's step and its calls in its own step
        assert len(names) == 4 + 3 * 4 and names[4] == "disc.blocks.0#0" and names[-1] == "disc.blocks.3#2"
        assert any(n.endswith("#0") for n in chosen if n.startswith("disc")) and any(n.endswith("#2") for n in chosen)
    else:  # one call of each block per pass
        assert names == [f"net.blocks.{i}#{k}" for k in range(2) for i in range(N_BLOCKS)]
        assert any(n.endswith("#0") for n in chosen) and any(n.endswith("#1") for n in chosen)
    # (the GAN steps two optimizers per batch: Lightning's max_steps counts optimizer steps)
    assert cb.plan.fits and len(peaks.peaks) >= 2 and max(peaks.peaks) <= budget
    assert len(model.losses) == len(reference.losses) > 0
    assert all(torch.equal(a, b) for a, b in zip(model.losses, reference.losses))
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p, q)
