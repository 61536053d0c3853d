"""A model written outside this project: MONAI's 2-D ResNet with BatchNorm, its stem, stages and
head as the chain. Whole-step predicted peaks (parameters, gradients, AdamW state, the batch,
activations) against the live-storage tracker, for no checkpointing, every block and optimal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from monai.networks.nets import ResNet

from lightning_ckpt import make_plan, measure_step_peak, profile_model, resolve_blocks, static_memory
from lightning_ckpt.apply.segments import apply_segments

# conv1, bn1 and maxpool are the stem (its in-place ReLU runs between bn1 and maxpool, outside
# the chain: a block that overwrites its own input cannot be recomputed); avgpool + fc the head.
CHAIN = ["conv1", "bn1", "maxpool", "layer1", "layer2", "layer3", "layer4", "fc"]
BATCH = 16


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = ResNet("basic", [1, 1, 1, 1], [16, 32, 64, 128], spatial_dims=2, n_input_channels=3, num_classes=4)
    batch = (torch.randn(BATCH, 3, 64, 64), torch.randint(0, 4, (BATCH,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(b):
        return F.cross_entropy(model(b[0]), b[1])

    loss_fn(batch).backward()  # one real step: gradients and AdamW state exist
    opt.step()
    _, names, blocks = resolve_blocks(model, CHAIN)
    profile = profile_model(model, blocks, loss_fn, batch, (1, 2), 4, names=names, timing=False)
    static = static_memory(model, [opt])
    cost = profile.at(BATCH, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes)
    return model, opt, batch, loss_fn, blocks, cost


def test_the_batch_is_counted_once_in_the_step_not_in_the_first_block(resnet):
    *_, cost = resnet
    assert cost.batch_bytes == BATCH * 3 * 64 * 64 * 4 + BATCH * 8
    assert cost.blocks[0].saved_bytes == 0 and cost.blocks[0].input_bytes == 0  # conv1 saves only the batch


@pytest.mark.parametrize("policy", ["none", "full", "optimal"])
def test_whole_step_predicted_within_3_percent(resnet, policy):
    model, opt, batch, loss_fn, blocks, cost = resnet
    none, full = (make_plan(cost, p).predicted_peak_bytes for p in ("none", "full"))
    budget = (none + full) // 2 if policy == "optimal" else None
    plan = make_plan(cost, policy, budget)
    handle = apply_segments(blocks, plan.segments, inner_segments=plan.inner_segments)
    try:
        measured = measure_step_peak(model, loss_fn, batch, opt)
    finally:
        handle.remove()
    assert abs(plan.predicted_peak_bytes - measured) / measured < 0.03, (plan.segments, plan.predicted_peak_bytes, measured)
    if budget is not None:
        assert plan.checkpointed and measured <= budget
