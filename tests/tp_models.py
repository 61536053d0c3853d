"""A Llama-like block for tensor-parallel tests: RMSNorm, attention with q/k/v/o, a gated MLP, no biases.

`tp_plan` is the column-wise / row-wise plan `parallelize_module` takes (with sequence parallelism:
the norms sharded along the sequence, the projections gathering and scattering it); `fake_world`
starts torch's fake process group in this process, for arithmetic on real DTensors without peers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DIM = 8


class LlamaBlock(nn.Module):
    """Pre-norm attention and gated MLP; `inner` and `hidden` are what one rank holds of a shard
    (the head count follows from the q/k/v outputs it gets)."""

    def __init__(self, d: int = 32, inner: int | None = None, hidden: int | None = None) -> None:
        super().__init__()
        inner, hidden = inner or d, hidden or 2 * d
        self.attn_norm = nn.RMSNorm(d)
        self.q = nn.Linear(d, inner, bias=False)
        self.k = nn.Linear(d, inner, bias=False)
        self.v = nn.Linear(d, inner, bias=False)
        self.o = nn.Linear(inner, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        b, s = h.shape[0], h.shape[1]
        q, k, v = (p(h).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(a)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def tp_plan(sequence_parallel: bool = False) -> dict:
    """The block's `parallelize_module` plan: q/k/v, gate and up column-wise, o and down row-wise."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        col, row = ColwiseParallel, RowwiseParallel
        return {"q": col(), "k": col(), "v": col(), "o": row(), "gate": col(), "up": col(), "down": row()}
    plan: dict = {n: ColwiseParallel(input_layouts=Shard(1)) for n in ("q", "k", "v", "gate", "up")}
    plan.update({n: RowwiseParallel(output_layouts=Shard(1)) for n in ("o", "down")})
    plan.update({n: SequenceParallel() for n in ("attn_norm", "mlp_norm")})
    return plan


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """torch's fake process group (collectives do nothing) as the default group, removed after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; the fake one needs it free")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
