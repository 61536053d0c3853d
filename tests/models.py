"""Small models for tests: a chain of transformer-ish blocks and a BatchNorm CNN."""

from __future__ import annotations

import torch
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class TinyChain(nn.Module):
    """Embedding -> n residual blocks -> mean pool -> head."""

    def __init__(self, n_blocks: int = 6, d: int = 16, vocab: int = 50, n_classes: int = 3, p: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MLPBlock(d, p) for _ in range(n_blocks))
        self.head = nn.Linear(d, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x.mean(dim=1))


class ConvBlock(nn.Module):
    def __init__(self, c: int, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class TinyCNN(nn.Module):
    def __init__(self, n_blocks: int = 4, c: int = 4, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(c, momentum) for _ in range(n_blocks)))
        self.head = nn.Linear(c, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def tokens_batch(batch: int = 4, seq: int = 12, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, 3, (batch,), generator=g)


def train_steps(model: nn.Module, batches, steps: int = 3, lr: float = 0.1):
    """Plain SGD steps; returns the losses and the final gradients by name."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads
