"""`auto_checkpoint` under Fabric: after `fabric.setup`, on one CPU process and on two (DDP, gloo):
the user's block names, losses bit-identical to the same loop without it, every step within the
budget, rank 0's plan on every rank, no hook left."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from models import TinyChain, tokens_batch

from lightning_ckpt import auto_checkpoint, measure_step_peak

BATCH, STEPS = 8, 3


def _loop(fabric: Fabric, budget: int | None, lengths=(16, 16, 16)) -> dict:
    """The user's Fabric loop; with `budget`, under auto_checkpoint. -> losses, peaks, plans."""
    fabric.seed_everything(0)
    model = TinyChain(n_blocks=6, d=32, p=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    rank = fabric.global_rank
    batches = [tokens_batch(BATCH, s, seed=10 * rank + i) for i, s in enumerate(lengths)]

    def step_fn(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    handle = None
    if budget is not None:
        handle = auto_checkpoint(
            model, budget, example_batch=batches[0], step_fn=step_fn, optimizer=opt, blocks="blocks",
            cost_metric="flops", verbose=False,
        )
    losses, peaks, plans = [], [], []
    for batch in batches:  # training steps, each measured whole (optimizer step included)
        if handle is not None:
            handle.step(batch)
            plans.append(handle.plan.segments)
        peaks.append(measure_step_peak(model, step_fn, batch, opt))
    for batch in batches:  # and as the user writes them, with fabric.backward
        if handle is not None:
            handle.step(batch)
        loss = step_fn(batch)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    hooks = None
    if handle is not None:
        names = handle.block_names
        handle.remove()
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    else:
        names = None
    return {"losses": losses, "peaks": peaks, "plans": plans, "names": names, "hooks": hooks,
            "params": [p.detach().clone() for p in model.parameters()]}


def _budget() -> int:
    from test_auto_checkpoint import _budget as half_way

    torch.manual_seed(0)
    return half_way(TinyChain(n_blocks=6, d=32, p=0.1), tokens_batch(BATCH, 16, seed=0))


def test_one_process():
    budget = _budget()
    fabric = Fabric(accelerator="cpu", devices=1)
    ref = _loop(fabric, None)
    got = _loop(fabric, budget)
    assert got["names"] == [f"blocks.{i}" for i in range(6)]  # the user's module's names, not Fabric's
    assert got["plans"][0] and all(torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))
    assert max(got["peaks"]) <= budget < max(ref["peaks"]) + 1
    assert got["hooks"] == 0


def _ddp_worker(fabric: Fabric, budget: int, lengths_by_rank: list) -> dict:
    """Run on each rank: the plain loop and the checkpointed one, one after the other."""
    lengths = lengths_by_rank[fabric.global_rank]
    ref = _loop(fabric, None, lengths)
    got = _loop(fabric, budget, lengths)
    same = all(torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"]))
    same_params = all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))
    mine = {"same": same, "same_params": same_params, "plans": got["plans"], "peaks": got["peaks"],
            "hooks": got["hooks"], "names": got["names"]}
    every: list = [None] * fabric.world_size
    torch.distributed.all_gather_object(every, mine)
    # gloo's threads stopped here, with both ranks done, not at the interpreter's exit (a rank once
    # aborted there: "terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return every


@pytest.mark.slow
def test_two_ddp_processes_share_rank_zero_s_plan():
    budget = _budget()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn")
    # rank 1's second batch is longer: both ranks run the plan of the longer shape at that step
    results = fabric.launch(_ddp_worker, budget, [(16, 16, 12), (16, 20, 12)])
    assert results is not None and len(results) == 2
    for r in results:
        assert r["same"] and r["same_params"] and r["hooks"] == 0 and r["names"][0] == "blocks.0"
        assert max(r["peaks"]) <= budget
    assert results[0]["plans"] == results[1]["plans"]  # rank 0's plan on both, at every step
    assert results[0]["plans"][1] != results[0]["plans"][0]  # the longer batch of rank 1 got its own plan
