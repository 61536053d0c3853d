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


class PostNormBlock(nn.Module):
    """BERT's output sublayer in small: a linear layer and dropout, held while LayerNorm runs on its sum
    with the input (as HF BERT's `hidden_states`); LayerNorm saves its mean and rstd after making its
    output, so the block's output exists when the block saves its last tensor."""

    def __init__(self, d: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        return self.norm(h + x)


class PostNormAttentionBlock(nn.Module):
    """BERT's attention sublayer in small: attention through torch's fused kernel (the CPU's is tagged
    random for its dropout, here 0), residual dropout, then LayerNorm on the sum."""

    def __init__(self, d: int = 16, heads: int = 2, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        return self.norm(x + self.drop(self.out(a)))


class AttentionChain(TinyChain):
    """`TinyChain` with `PostNormAttentionBlock`s."""

    def __init__(self, n_blocks: int = 4, d: int = 16, vocab: int = 50, n_classes: int = 3, p: float = 0.1) -> None:
        super().__init__(n_blocks, d, vocab, n_classes, p)
        self.blocks = nn.ModuleList(PostNormAttentionBlock(d, p=p) for _ in range(n_blocks))


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


def loop_steps(step_fn, batches, optimizer, handle=None) -> list[torch.Tensor]:
    """A plain training loop in Lightning's order (`handle.step(batch)` first when an
    `auto_checkpoint` handle is given); -> the losses."""
    losses = []
    for batch in batches:
        if handle is not None:
            handle.step(batch)
        loss = step_fn(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def steps_with_peaks(model: nn.Module, loss_fn, batches, handle=None, optimizer=None, between=None):
    """Train `model` one AdamW (or `optimizer`) step per batch, each step's whole peak measured first
    (`measure_step_peak`, a step of its own, in every run alike): the seed is set before each, so two runs
    draw alike. `handle.step(batch)` first when an `auto_checkpoint` handle is given; `between(i)` is called
    right before each training forward. -> (losses, peaks)."""
    from lightning_ckpt import measure_step_peak

    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peaks = [], []
    for i, batch in enumerate(batches):
        if handle is not None:
            handle.step(batch)
        torch.manual_seed(100 + i)
        peaks.append(measure_step_peak(model, loss_fn, batch, opt))
        torch.manual_seed(i)
        if between is not None:
            between(i)
        loss = loss_fn(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, peaks


class IdentityWrap(torch.autograd.Function):
    """An identity autograd Function like those DeepSpeed ZeRO-3 puts around every module's
    inputs and outputs: the forward returns `x.detach()` (a new tensor object on the same
    storage), the backward hands the gradient back unchanged."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def wrap_like_zero3(model: nn.Module) -> dict[nn.Module, int]:
    """Hooks on every module of `model`, as DeepSpeed ZeRO-3 registers them: a forward pre-hook
    replaces each tensor argument by `IdentityWrap.apply(arg)`, a forward hook the output.
    Returns how many times each module's pre-hook ran (a recompute runs it again)."""
    calls = {m: 0 for m in model.modules()}

    def wrap(value):
        if isinstance(value, torch.Tensor):
            return IdentityWrap.apply(value)
        if isinstance(value, (tuple, list)):
            return type(value)(wrap(v) for v in value)
        return value

    def pre(module, args):
        calls[module] += 1
        return wrap(args)

    for m in model.modules():
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(lambda module, args, output: wrap(output))
    return calls


class FedChain(TinyChain):
    """`TinyChain` whose forward passes `feed(x)`, not `x`, from each block to the next."""

    def __init__(self, feed, **kw) -> None:
        super().__init__(**kw)
        self.feed = feed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for k, blk in enumerate(self.blocks):
            x = blk(self.feed(x) if k else x)
        return self.head(x.mean(dim=1))
