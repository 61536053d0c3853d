"""Tensor-parallel work per rank: FLOPs, bytes written and collectives of a block on its local shards.

A Llama-like block parallelised with `parallelize_module` on torch's fake two-rank process group
(one process): the probe's counts per block against torch's FLOP counter on the same block built
at the local shard sizes, and the collectives each plan runs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt.profiling.passes.profiler import probe_step
from lightning_ckpt.profiling.work.tp_work import ALL_REDUCE_FACTOR, collective_bytes, comm_bytes, has_dtensor, is_collective
from tp_models import LlamaBlock, fake_world, tp_plan

B, S, D = 2, 16, 32
FP32 = 4


def _profile(sequence_parallel: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(LlamaBlock(D), LlamaBlock(D))
    mesh = init_device_mesh("cpu", (2,))
    for block in model:
        parallelize_module(block, mesh, tp_plan(sequence_parallel))
    x = torch.randn(B, S // 2 if sequence_parallel else S, D)  # sequence parallel: this rank's half
    return probe_step(model, list(model), lambda b: model(b).pow(2).mean(), x, timing=False), model


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_flops_are_the_rank_share(sequence_parallel):
    """Every block's forward FLOPs equal torch's counter on the block built at the local sizes (half
    the heads, half the MLP): half of the unsharded block's; the gradients are the local shards'."""
    with fake_world(2):
        cost, model = _profile(sequence_parallel)
        local = sum(p.to_local().numel() if has_dtensor(p) else p.numel() for p in model[0].parameters())
    with FlopCounterMode(display=False) as shard:
        LlamaBlock(D, inner=D // 2, hidden=D)(torch.randn(B, S, D))
    with FlopCounterMode(display=False) as whole:
        LlamaBlock(D)(torch.randn(B, S, D))
    assert shard.get_total_flops() == whole.get_total_flops() // 2
    for block in cost.blocks:
        assert block.fwd_flops == shard.get_total_flops(), block.name
        assert block.grad_bytes == FP32 * local
    assert local < sum(p.numel() for p in LlamaBlock(D).parameters())


def test_collectives_of_each_plan():
    """Without sequence parallelism a block all-reduces the (B, S, D) activation twice (o and down),
    the second after its last saved tensor; with it, q, k, v, gate and up all-gather the sequence
    and o and down reduce-scatter it, the last one in the tail."""
    act = B * S * D * FP32
    with fake_world(2):
        tp, _ = _profile(False)
        sp, _ = _profile(True)
    for block in tp.blocks:
        assert block.fwd_comm_bytes == 2 * ALL_REDUCE_FACTOR * act
        assert block.tail_comm_bytes == ALL_REDUCE_FACTOR * act
    for block in sp.blocks:
        assert block.fwd_comm_bytes == 5 * act + 2 * act
        assert block.tail_comm_bytes == act


def test_collective_bytes_by_kind():
    f = torch.ops._c10d_functional
    t = torch.empty(8, 4)
    assert is_collective(f.all_reduce.default) and not is_collective(torch.ops.aten.mm.default)
    assert collective_bytes(f.all_reduce.default, (t, "sum", "0"), {}, [t]) == 2 * 128
    assert collective_bytes(f.all_gather_into_tensor.default, (t[:4], 2, "0"), {}, [t]) == 128
    assert collective_bytes(f.reduce_scatter_tensor.default, (t, "sum", 2, "0"), {}, [t[:4]]) == 128
    assert collective_bytes(f.wait_tensor.default, (t,), {}, [t]) == 0
    assert comm_bytes((5, 6)) == 0 and comm_bytes((5, 6, 7)) == 7
