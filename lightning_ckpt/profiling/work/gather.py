"""What a checkpointed block's recompute all-gathers again under sharding, and at what rate.

DeepSpeed ZeRO-3 releases a block's partitioned parameters after each forward, so the
recompute fetches them again: `recompute_gather_bytes` is their unsharded bytes (one
all-gather more per checkpointed block and step, counted on two CPU ranks). FSDP2 runs a
recompute inside the backward after its pre-backward hook has gathered the block, and
keeps what the recompute gathers until the block's own backward: no all-gather is added
(torch 2.13), so FSDP2 blocks gather 0 bytes more. `measure_gather_rate` times
`all_gather_into_tensor` on the default process group, the same number on every rank.
`with_recompute_gather` puts both into a profile (`BlockCost.gather_bytes`, `MachineRates.gather_byte_per_s`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
from torch import nn

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile

__all__ = ["measure_gather_rate", "recompute_gather_bytes", "sharded_world_size", "with_recompute_gather"]

# Per-rank input elements (fp32) of the timed all-gather, grown until one call takes `min_call_s`.
_ELEMENT_COUNTS = (2**16, 2**18, 2**20, 2**22, 2**24)


def _is_zero3(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def _is_fsdp2(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(p, DTensor)


def sharded_world_size(blocks: Sequence[nn.Module]) -> int:
    """Ranks of the default process group when some block's parameters are sharded
    (ZeRO-3 or FSDP2) over it, else 1 (not sharded, or no process group)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return 1
    sharded = any(_is_zero3(p) or _is_fsdp2(p) for b in blocks for p in b.parameters())
    return dist.get_world_size() if sharded else 1


def recompute_gather_bytes(block: nn.Module) -> int:
    """Parameter bytes the block's recompute all-gathers beyond a step without checkpointing:
    its ZeRO-3 partitioned parameters that are not persistent (`ds_persist`), unsharded."""
    seen, total = set(), 0
    for p in block.parameters():
        if id(p) in seen or not _is_zero3(p) or getattr(p, "ds_persist", False):
            continue
        seen.add(id(p))
        total += int(p.ds_numel) * p.element_size()
    return total


def measure_gather_rate(
    device: str | torch.device = "cpu", repeats: int = 5, min_call_s: float = 5e-4
) -> float:
    """Bytes per second (of the output) of `all_gather_into_tensor` on the default process group.

    A collective: every rank must call it. Sizes grow until one call takes `min_call_s`
    on the slowest rank; the rate is that of the fastest of `repeats` calls, each taken on
    the slowest rank (an all-reduce of the times), so every rank gets the same number.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "measure_gather_rate times an all-gather on the default process group, but none is initialised; "
            "call it inside distributed training (or torch.distributed.init_process_group first)."
        )
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1; the rate is that of the fastest of that many calls.")
    device = torch.device(device)
    world = dist.get_world_size()

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(out: torch.Tensor, inp: torch.Tensor) -> float:
        sync()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(out, inp)
        sync()
        return time.perf_counter() - t0

    for n in _ELEMENT_COUNTS:
        inp = torch.ones(n, dtype=torch.float32, device=device)
        out = torch.empty(n * world, dtype=torch.float32, device=device)
        dist.all_gather_into_tensor(out, inp)  # warm-up: buffers and connections set up
        if slowest(timed(out, inp)) >= min_call_s or n == _ELEMENT_COUNTS[-1]:
            best = min(slowest(timed(out, inp)) for _ in range(repeats))
            return out.numel() * out.element_size() / max(best, 1e-9)
    raise AssertionError("unreachable")


def with_recompute_gather(profile: Profile, blocks: Sequence[nn.Module]) -> Profile:
    """`profile` with each block's `gather_bytes` and the all-gather rate in its rates, when
    the blocks are sharded over more than one rank; else unchanged. Every rank must call it."""
    if sharded_world_size(blocks) < 2:
        return profile
    gathers = [recompute_gather_bytes(b) for b in blocks]
    rate = measure_gather_rate(profile.probes[-1].meta.get("work", {}).get("device", "cpu"))

    def update(cost: StepCost | None) -> StepCost | None:
        if cost is None:
            return None
        new = tuple(dataclasses.replace(b, gather_bytes=g) for b, g in zip(cost.blocks, gathers))
        meta = dict(cost.meta)
        if cost.rates is not None:
            meta["rates"] = dataclasses.replace(cost.rates, gather_byte_per_s=rate).to_dict()
        return dataclasses.replace(cost, blocks=new, meta=meta)

    return Profile(probes=tuple(update(p) for p in profile.probes), check=update(profile.check))  # type: ignore[arg-type]
