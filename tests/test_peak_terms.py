"""The end of a segment's recompute (`peak_terms.recompute_scratch_bytes`) and the loss through the
backward (`lifetimes.carried_terms`): torch's early stop ends a recompute at its last block's last saved
tensor, and a block shaped like BERT's output layer (a LayerNorm of a dropout's output plus the input) has
made its output by then (`BlockCost.stop_output_bytes`); the caller holds the loss while it backpropagates.
On a chain of three such blocks every plan's predicted peak equals the peak of live storages counted by
the tests' own dispatch mode (`storage_oracle`), for segments of one to three blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from oracles import all_plans
from storage_oracle import LiveStorages, step_state
from torch import nn

from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.profiling.passes.profiler import probe_step
from lightning_ckpt.profiling.memory.static_memory import static_memory

BATCH, TOKENS, D = 4, 64, 16


class OutputLayer(nn.Module):
    """Linear, GELU, Linear, dropout, then a LayerNorm of the sum with the input (BERT's intermediate and
    output layers): the norm's output is the block's, made before the norm saves its statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.drop, self.norm = nn.Dropout(0.1), nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.down(F.gelu(self.up(x))))
        h = self.norm(h + x)  # (`h` holds the dropout's output until the norm returns)
        return h


@pytest.fixture(scope="module")
def output_chain():
    torch.manual_seed(0)
    model = nn.Sequential(*(OutputLayer() for _ in range(3)))
    x = torch.randn(BATCH, TOKENS, D, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(batch):
        return model(batch).square().mean()

    loss_fn(x).backward()  # one real step: gradients and AdamW state exist
    opt.step()
    cost = probe_step(model, list(model), loss_fn, x, timing=False)
    static = static_memory(model, [opt])
    cost = dataclasses.replace(cost, static_bytes=static.resident_bytes,
                               optimizer_transient_bytes=static.optimizer_transient_bytes)
    return model, opt, x, loss_fn, cost


def _measured(model, opt, x, loss_fn, segments) -> int:
    """Peak live storages of one step in Lightning's order (forward, `zero_grad`, backward, optimizer step)."""
    handle = apply_segments(list(model), segments)
    try:
        with LiveStorages() as mode:
            mode.count(step_state(model, opt) + [x])
            loss = loss_fn(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            del loss
    finally:
        handle.remove()
    return mode.peak


def test_every_plan_predicted_as_measured(output_chain):
    model, opt, x, loss_fn, cost = output_chain
    misses = {}
    for segments in all_plans(len(cost.blocks)):
        predicted = predict_peak(cost, segments)
        misses[tuple(segments)] = (_measured(model, opt, x, loss_fn, segments) - predicted.peak_bytes, predicted.phase)
    assert len(misses) == 13
    # the plans that peak where a segment's recompute ends, one to three blocks long
    at_end = {s for s, (_, phase) in misses.items() if phase.startswith("backward") and s}
    assert {b - a + 1 for s in at_end for a, b in s} >= {1, 2, 3}, misses
    assert all(miss == 0 for miss, _ in misses.values()), misses
