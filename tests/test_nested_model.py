"""The memory terms and recompute rule of multi-level plans, against measurements.

Peaks: every multi-level plan of a small chain is applied and its step measured by the
live-storage tracker; `predict_peak` must never be under and at most a fraction of one
activation over, on a chain whose neighbours save the same storage (ReLU then Linear) and
on a residual chain with LayerNorm, GELU and dropout. Recomputes: `recompute_counts` (the
rule `nested_segment_cost` charges) must equal how often each block really runs in the
backward.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from models import MLPBlock
from oracles import all_nested_plans
from test_memory_model import make_relu_chain
from torch import nn

from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.planning.memory_model import predict_peak, step_terms
from lightning_ckpt.planning.nested_model import (
    depth_of,
    direct_children,
    inner_elements,
    nested_backward,
    recompute_counts,
    validate_nested,
)
from lightning_ckpt.planning.recompute_cost import recompute_cost
from lightning_ckpt.profiling.passes.profiler import probe_step
from lightning_ckpt.profiling.memory.static_memory import static_memory
from lightning_ckpt.profiling.memory.step_peak import measure_step_peak


def test_validate_nested_returns_the_inner_segments_sorted():
    assert validate_nested(8, [(0, 7)], [(5, 6), (1, 2), (0, 3)]) == [(0, 3), (1, 2), (5, 6)]
    assert validate_nested(8, [(0, 3), (4, 7)], [(0, 2), (4, 6), (0, 0)]) == [(0, 0), (0, 2), (4, 6)]
    assert validate_nested(8, [(0, 7)], []) == []


def test_children_and_elements_read_the_family_parent_first():
    inner = [(0, 0), (0, 1), (2, 2), (4, 6), (5, 5)]
    assert direct_children(0, 7, inner) == [(0, 1), (2, 2), (4, 6)]
    assert direct_children(0, 1, inner) == [(0, 0)]
    assert inner_elements(0, 7, inner) == [(0, 1, True), (2, 2, True), (3, 3, False), (4, 6, True), (7, 7, False)]
    assert depth_of([(0, 7)], inner) == 3 and depth_of([(0, 7)], []) == 1 and depth_of([], []) == 0


@pytest.mark.parametrize(
    ("inner", "runs"),
    [
        ([(0, 1), (3, 4)], [2, 2, 1, 2, 2, 1]),
        ([(0, 2), (3, 5)], [2, 2, 2, 1, 1, 1]),  # the outer recompute stops at its last child's input
        ([(0, 4), (1, 3), (2, 2)], [2, 3, 4, 3, 2, 1]),
        ([], [1, 1, 1, 1, 1, 1]),
    ],
)
def test_recompute_counts_by_hand(inner, runs):
    assert recompute_counts(6, [(0, 5)], inner) == runs


def _chain(n: int, d: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(MLPBlock(d, 0.1) for _ in range(n)))


def test_recompute_counts_equal_the_runs_of_every_block():
    """For every two- and three-level plan of five blocks, each block's forward runs during the
    backward (counted at its first layer) are what `recompute_counts` says."""
    model = _chain(5)
    blocks = list(model)
    calls = [0] * 5
    for i, blk in enumerate(blocks):  # counted inside the block: a recompute that stops in its pre-hook did not run it
        blk.norm.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    free = StepCost(blocks=tuple(BlockCost(f"b{i}", 1, 1) for i in range(5)), batch_size=1)
    plans = [(s, sorted(i)) for s, i in all_nested_plans(free, 3) if i]
    assert len(plans) > 150
    plans = random.Random(0).sample(plans, 150)
    x = torch.randn(3, 4, 8)
    for segs, inner in plans:
        handle = apply_segments(blocks, segs, inner_segments=inner)
        try:
            out = model(x).sum()
            calls[:] = [0] * 5
            out.backward()
        finally:
            handle.remove()
        assert calls == recompute_counts(5, segs, inner), (segs, inner)


def test_no_children_is_the_plain_segment_and_children_lower_the_backward():
    block = BlockCost("b", saved_bytes=100, input_bytes=4, input_saved_bytes=4, output_bytes=4, fwd_transient_bytes=3,
                      bwd_transient_bytes=5, grad_bytes=2, fwd_flops=10)
    cost = StepCost(blocks=(block,) * 6, batch_size=1, static_bytes=50)
    terms = step_terms(cost)
    plain = predict_peak(cost, [(0, 5)])
    assert predict_peak(cost, [(0, 5)], None, []) == plain
    # one child per block: the recompute holds six boundaries, then one block rebuilt at a time
    nested = predict_peak(cost, [(0, 5)], None, [(i, i) for i in range(6)])
    assert nested.backward_bytes < plain.backward_bytes and nested.forward_bytes == plain.forward_bytes
    # by hand: the last child's backward: 5 boundaries + its own rebuilt block (x - xs + saved + grads
    # of later blocks + the output's gradient + its scratch), on top of the step's base and x_0
    # kept resident by the outer segment (counted once with the first child, which starts at 0)
    need, at = nested_backward(cost, 0, 5, [(i, i) for i in range(6)], terms, lambda a, b: _plain(cost, terms, a, b))
    assert at == 5
    assert need == 5 * 4 + (4 - 4) + 100 + 0 + 4 + max(5, 3)
    assert recompute_cost(cost, [(0, 5)], "flops", None, [(i, i) for i in range(6)]) == 50 + 60


def _plain(cost, terms, a, b):
    from lightning_ckpt.planning.memory_model import segment_elements

    return next(e for e in segment_elements(cost, a, terms) if e.last == b)


def _measured_errors(model, opt, batch, loss_fn, cost, plans, unit):
    blocks = list(model.blocks)
    errors = {}
    for segs, inner in plans:
        handle = apply_segments(blocks, segs, inner_segments=inner)
        try:
            measured = measure_step_peak(model, loss_fn, batch, opt)
        finally:
            handle.remove()
        errors[(tuple(segs), tuple(inner))] = (predict_peak(cost, segs, None, inner).peak_bytes - measured) / unit
    return errors


def test_relu_chain_every_nested_plan_predicted_within_a_third_of_one_activation():
    """Neighbours share storages here (a block's ReLU output is the next Linear's input)."""
    model, opt, batch, loss_fn, cost = make_relu_chain()
    plans = [(s, sorted(i)) for s, i in all_nested_plans(cost, 3) if i]
    rng = random.Random(0)
    plans = rng.sample(plans, 60)
    errors = _measured_errors(model, opt, batch, loss_fn, cost, plans, unit=4 * 256 * 64)
    assert min(errors.values()) >= -1 / 16, {k: e for k, e in errors.items() if e < -1 / 16}
    assert max(errors.values()) <= 1 / 3, {k: e for k, e in errors.items() if e > 1 / 3}


class ResidualChain(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, 0.1) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x.mean(1))


def test_residual_chain_nested_plans_predicted_within_five_percent():
    torch.manual_seed(0)
    model = ResidualChain(6, 64)
    x, y = torch.randn(32, 16, 64), torch.randint(0, 3, (32,))
    opt = torch.optim.AdamW(model.parameters())

    def loss_fn(batch):
        return nn.functional.cross_entropy(model(batch[0].clone()), batch[1])

    loss_fn((x, y)).backward()
    opt.step()
    cost = probe_step(model, list(model.blocks), loss_fn, (x, y), timing=False)
    static = static_memory(model, [opt])
    cost = dataclasses.replace(cost, static_bytes=static.resident_bytes,
                               optimizer_transient_bytes=static.optimizer_transient_bytes)
    plans = [(s, sorted(i)) for s, i in all_nested_plans(cost, 3) if i]
    plans = random.Random(1).sample(plans, 40) + [([(0, 5)], [(i, i) for i in range(6)])]
    errors = _measured_errors(model, opt, (x, y), loss_fn, cost, plans, unit=1)
    peaks = {k: predict_peak(cost, list(k[0]), None, list(k[1])).peak_bytes for k in errors}
    rel = {k: e / (peaks[k] - e) for k, e in errors.items()}
    assert min(rel.values()) >= -0.005, {k: r for k, r in rel.items() if r < -0.005}
    assert max(rel.values()) <= 0.05, {k: r for k, r in rel.items() if r > 0.05}
