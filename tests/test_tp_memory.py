"""Per-rank sizes of DTensor parameters: torch's chunking as arithmetic, and the static memory of a
tensor-parallel model (parameters, gradients, optimizer state by local shard) on torch's fake
process group, rank 0 and rank 1 of an uneven shard; a gradient by the storage it keeps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ckpt.profiling.memory.static_memory import static_memory
from lightning_ckpt.profiling.memory.tp_memory import grad_held_bytes, largest_shard_numel, local_nbytes, shard_shape
from tp_models import LlamaBlock, fake_world, tp_plan


def test_shard_shape_follows_torch_chunk():
    assert shard_shape((10, 3), (4,), (0,), (0,)) == (3, 3)
    assert [shard_shape((10, 3), (4,), (0,), (i,))[0] for i in range(4)] == [3, 3, 3, 1]
    assert [shard_shape((5,), (4,), (0,), (i,))[0] for i in range(4)] == [2, 2, 1, 0]  # a rank may hold none
    assert shard_shape((10, 6), (2, 3), (None, 1), (1, 2)) == (10, 2)  # replicated on the first mesh dim
    assert shard_shape((10, 6), (2, 2), (0, 0), (1, 1)) == (2, 6)  # 10 -> 5 -> 3, 2
    assert largest_shard_numel((10, 6), (2, 2), (0, 0)) == 3 * 6
    with pytest.raises(ValueError, match=r"Shard\(2\) at mesh index 0 of 2 does not fit a tensor of shape \(10, 6\)"):
        shard_shape((10, 6), (2,), (2,), (0,))
    with pytest.raises(ValueError, match="one entry per mesh dimension"):
        shard_shape((10, 6), (2, 2), (0,), (0, 0))


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_shard_shape_matches_dtensor(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with fake_world(4, rank):
        mesh = init_device_mesh("cpu", (2, 2))
        coordinate = mesh.get_coordinate()
        for shape, placements in (((10, 6), (Shard(0), Shard(0))), ((7, 5), (Replicate(), Shard(1))),
                                  ((3, 9), (Shard(1), Shard(0)))):
            local = distribute_tensor(torch.zeros(shape), mesh, placements).to_local()
            dims = [p.dim if isinstance(p, Shard) else None for p in placements]
            assert tuple(local.shape) == shard_shape(shape, (2, 2), dims, coordinate), (shape, placements)


@pytest.mark.parametrize("rank", [0, 1])
def test_static_memory_counts_local_shards(rank):
    """Colwise/rowwise q, k, v, o, gate, up, down: half each per rank; the norms replicated (whole);
    a column-wise head of 5 outputs, uneven: 3 on rank 0 and 2 on rank 1. Gradients and AdamW's
    state follow the local shard, before the first step (estimated) and after it (counted). (The fake
group's collectives cannot run an uneven backward on rank 1: the gradients are set, not computed.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    d = 32
    with fake_world(2, rank):
        torch.manual_seed(0)
        model = nn.Sequential(LlamaBlock(d), nn.Linear(d, 5, bias=False))
        mesh = init_device_mesh("cpu", (2,))
        parallelize_module(model[0], mesh, tp_plan())
        parallelize_module(model[1], mesh, ColwiseParallel())
        head = model[1].weight.to_local().shape[0]
        assert head == (3, 2)[rank]
        local = (4 * d * d + 3 * 2 * d * d) // 2 + 2 * d + head * d  # projections halved, two norms, the head
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = static_memory(model, [opt])
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # a DTensor like its parameter: the local shard's size
        opt.step()
        after = static_memory(model, [opt])
        held = sum(local_nbytes(p.grad) for p in model.parameters())
    assert before.grad_bytes == 4 * local == held
    # the parameters by their storage: torch may keep an uneven shard in a chunk of the largest size
    assert before.param_bytes in (4 * local, 4 * (local + (3 - head) * d))
    assert before.optimizer_state_bytes == 2 * 4 * local + 4 * 10  # two moments and a step per parameter
    assert after.optimizer_state_bytes == before.optimizer_state_bytes
    assert before.optimizer_transient_bytes == 2 * 4 * d * d  # two of the largest local shard (gate: 2d x d halved)


def test_gradient_held_by_its_storage():
    """A gradient alone on a larger storage holds all of it; gradients viewing one buffer (DDP's
    buckets) and parameters without one count their own size."""
    a, b, c, frozen = (nn.Parameter(torch.zeros(4)) for _ in range(4))
    frozen.requires_grad_(False)
    a.grad = torch.zeros(10)[:4]  # a chunk of a 40-byte storage, the only gradient on it
    bucket = torch.zeros(8)
    b.grad, c.grad = bucket[:4], bucket[4:]
    held = grad_held_bytes([a, b, c, frozen])
    assert held == {id(a): 40, id(b): 16, id(c): 16}
    c.grad = None
    assert grad_held_bytes([b, c]) == {id(b): 32, id(c): 16}  # b alone on the bucket now; c none yet


@pytest.mark.parametrize("rank", [0, 1])
def test_rowwise_embedding_gradient_keeps_the_vocabulary(rank):
    """A row-wise sharded embedding's gradient is its rank's rows of a gradient over the whole
    vocabulary, whose storage it keeps: counted so once it exists (a column-wise linear's is its shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with fake_world(2, rank):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
        mesh = init_device_mesh("cpu", (2,))
        parallelize_module(model, mesh, {"0": RowwiseParallel(input_layouts=Replicate()), "1": ColwiseParallel()})
        before = static_memory(model).grad_bytes
        model(torch.randint(0, 16, (2, 5))).sum().backward()
        held = grad_held_bytes(model.parameters())
        after = static_memory(model).grad_bytes
    embed, head = model[0].weight, model[1].weight
    assert local_nbytes(embed) == local_nbytes(head) == 8 * 8 * 4
    assert held == {id(embed): 16 * 8 * 4, id(head): 8 * 8 * 4}
    assert (before, after) == (2 * 8 * 8 * 4, 16 * 8 * 4 + 8 * 8 * 4)
