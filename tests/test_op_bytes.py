"""Bytes written by ops without FLOPs: hand-counted blocks, views, in-place ops, tails."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt.profiling.work.op_bytes import OpBytesCounter
from lightning_ckpt.profiling.passes.profiler import probe_step

B, T, D, H = 4, 6, 8, 12  # batch, tokens, width in, width of the linear block
F32 = 4


class ScaleShift(nn.Module):
    """LayerNorm, then two ops on a scalar that save nothing: they run after the last saved tensor."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x) * 2.0 + 1.0


class Chain(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x.mean()


def _probe(*blocks: nn.Module):
    torch.manual_seed(0)
    model = Chain(*blocks)
    x = torch.randn(B, T, D)
    return probe_step(model, list(model.blocks), lambda b: model(b), x, timing=False).blocks


def test_layer_norm_block_has_no_flops_and_writes_its_output_mean_and_rstd():
    ln, _ = _probe(nn.LayerNorm(D), nn.Linear(D, H))
    assert ln.fwd_flops == 0
    # native_layer_norm returns the normalised output (B*T*D) and mean and rstd (B*T each), fp32
    assert ln.fwd_mem_bytes == F32 * (B * T * D + 2 * B * T)
    assert ln.fwd_rng_bytes == 0
    # it saves its input before it runs and mean/rstd after: nothing is left after the last saved tensor
    assert ln.tail_mem_bytes == 0 and ln.tail_flops == 0


def test_linear_block_writes_nothing_beyond_its_matmul():
    """Defined so: a Linear is costed by its FLOPs alone. The matmul with its bias add is
    one `addmm` (FLOPs, so its output is not counted again as bytes) and the reshapes
    around it for a 3-d input are views (0 bytes)."""
    _, lin = _probe(nn.LayerNorm(D), nn.Linear(D, H))
    assert lin.fwd_flops == 2 * B * T * D * H
    assert lin.fwd_mem_bytes == 0 and lin.fwd_rng_bytes == 0 and lin.tail_mem_bytes == 0
    # addmm saves its input before it runs, so torch's early stop skips the whole matmul
    assert lin.tail_flops == lin.fwd_flops


def test_tail_bytes_are_the_ops_after_the_last_saved_tensor_like_tail_flops():
    (blk,) = _probe(ScaleShift(D))
    out = F32 * B * T * D
    assert blk.fwd_mem_bytes == F32 * (B * T * D + 2 * B * T) + 2 * out  # layer norm, then * 2.0 and + 1.0
    assert blk.tail_mem_bytes == 2 * out  # the two scalar ops save nothing
    assert blk.tail_flops == 0 == blk.fwd_flops


def test_dropout_writes_random_bytes_separately():
    """CPU dropout: empty_like (allocates, writes nothing), bernoulli_ (random), div_ and mul."""
    (drop,) = _probe(nn.Dropout(0.5))
    out = F32 * B * T * D
    assert drop.fwd_rng_bytes == out  # the float mask
    assert drop.fwd_mem_bytes == 2 * out  # div_ in place on the mask, then the masked input
    assert drop.tail_rng_bytes == 0  # the mask is saved (by mul, before it runs) ...
    assert drop.tail_mem_bytes == out  # ... so only mul follows the last saved tensor


def test_views_allocations_and_in_place_ops():
    x = torch.randn(16, 8)
    with FlopCounterMode(display=False) as flops, OpBytesCounter(flops) as counter:
        x.view(8, 16).t().unsqueeze(0).detach()  # views: nothing written
        torch.empty_like(x)  # allocation only
        assert counter.snapshot() == (0, 0)
        x.t().reshape(-1)  # flattening a transposed tensor copies it
        assert counter.snapshot() == (512, 0)
        x.mul_(2.0)  # in place: the mutated tensor's bytes
        assert counter.snapshot() == (2 * 512, 0)
        x.to(torch.float64)  # a copy in another dtype: its output
        assert counter.snapshot() == (2 * 512 + 1024, 0)
        x @ x.t()  # FLOPs: counted by the FLOP counter, not as bytes
        assert counter.snapshot() == (2 * 512 + 1024, 0)
        torch.rand(10)
    assert counter.snapshot() == (2 * 512 + 1024, 40)
    # float32 wrote 512 + 512 + 40 bytes, float64 1024: the rates are measured in float32
    assert counter.dominant() == {"device": "cpu", "flop_dtype": "torch.float32", "mem_dtype": "torch.float32"}


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_bytes_scale_linearly_with_the_batch(batch):
    torch.manual_seed(0)
    model = Chain(ScaleShift(D), nn.Linear(D, H))
    x = torch.randn(batch, T, D)
    blocks = probe_step(model, list(model.blocks), lambda b: model(b), x, timing=False).blocks
    assert blocks[0].fwd_mem_bytes == batch * F32 * (3 * T * D + 2 * T)
