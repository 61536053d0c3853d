"""The probe's one dispatch mode counts what the three stacked modes count, op by op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt.profiling.memory.lifetimes import StorageLedger
from lightning_ckpt.profiling.work.op_bytes import OpBytesCounter
from lightning_ckpt.profiling.passes.probe_counters import ProbeCounters
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker


class Attention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return x + self.drop(F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))


def _attention():
    return Attention(), torch.randn(3, 5, 16)


def _cnn():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3))
    return model, torch.randn(2, 3, 12, 12)


def _embedding():
    model = nn.Sequential(nn.Embedding(50, 12), nn.GELU(), nn.Dropout(0.2), nn.Linear(12, 7))
    return model, torch.randint(0, 50, (4, 9))


def _bf16_mlp():
    model = nn.Sequential(nn.Linear(10, 20), nn.SiLU(), nn.Linear(20, 10)).to(torch.bfloat16)
    return model, torch.randn(6, 10, dtype=torch.bfloat16)


def _step(model, x) -> None:
    out = model(x)
    loss = out.float().pow(2).mean() if out.is_floating_point() else out.sum()
    loss.backward()


def _counts(build, fused: bool):
    torch.manual_seed(0)
    model, x = build()
    calls: list = []

    def on_op(func, args, kwargs, outs, flops, mem, rng):
        calls.append((str(func), len(outs), flops, mem, rng))

    ledger = StorageLedger()
    if fused:
        with ProbeCounters(ledger=ledger) as counters:
            counters.on_op = on_op
            _step(model, x)
        flops, work, tracker = counters.get_total_flops(), counters, counters
    else:
        flop_mode = FlopCounterMode(display=False)
        with flop_mode, OpBytesCounter(flop_mode) as work, LiveBytesTracker(ledger=ledger) as tracker:
            work.on_op = on_op
            _step(model, x)
        flops = flop_mode.get_total_flops()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return {
        "flops": flops,
        "mem": work.mem_bytes,
        "rng": work.rng_bytes,
        "flop_dtypes": dict(work.flop_dtypes),
        "mem_dtypes": dict(work.mem_dtypes),
        "dominant": work.dominant(),
        "peak": tracker.peak_bytes,
        "live": tracker.live_bytes,
        "calls": calls,
        "ledger": ledger.mark(),
    }, grads


@pytest.mark.parametrize("build", [_attention, _cnn, _embedding, _bf16_mlp], ids=["attention", "cnn", "embedding", "bf16"])
def test_one_mode_counts_what_three_stacked_modes_count(build):
    fused, fused_grads = _counts(build, fused=True)
    stacked, stacked_grads = _counts(build, fused=False)
    assert fused["flops"] > 0 and fused["peak"] > 0 and fused["calls"]
    assert fused == stacked
    for a, b in zip(fused_grads, stacked_grads, strict=True):
        assert torch.equal(a, b)


def test_metadata_queries_are_left_to_the_tensor():
    with ProbeCounters() as counters:
        x = torch.randn(4, 4)
        assert x.is_contiguous() and x.size(0) == 4 and x.dim() == 2
    assert counters.get_total_flops() == 0
