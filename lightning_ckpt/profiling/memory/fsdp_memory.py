"""Per-rank static memory of PyTorch FSDP2 (`fully_shard`) with an Adam-style optimizer.

`fsdp_groups` reads each `FSDPParamGroup` of a sharded model as plain sizes; `fsdp_memory`
turns them into the bytes one rank holds, each term named after the FSDP2 structure it
stands for (padded shards, the reduce-scatter output the gradients view, the all-gather
outputs the unsharded parameters view); under `CPUOffloadPolicy` the shards, their gradients and
the optimizer state live in host memory and only the all-gather outputs and one group's copies stay
on the device. `fsdp_held_bytes` counts those structures on a live model, `fsdp_host_tensors` the
offloaded ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ckpt.profiling.memory.static_memory import StaticMemory
from lightning_ckpt.profiling.memory.tracker import local_tensor, unique_storage_bytes

ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each shaped like this rank's (unpadded) local shard
STEP_COUNTER_BYTES = 4  # torch's Adam keeps `step` as a float32 scalar tensor per parameter


@dataclass(frozen=True)
class FsdpGroupSizes:
    """One `FSDPParamGroup` (the parameters one `fully_shard` call manages), on this rank.

    padded_shard_elements: this rank's padded shards, summed (`FSDPParam._sharded_param_data`).
    local_shard_elements: the same without padding (the local tensors of the sharded DTensors).
    trainable_local_elements, trainable_params: what the optimizer keeps state for.
    orig_element_bytes: the parameters' own dtype (shards, gradients, optimizer state).
    unsharded_element_bytes: the all-gather dtype (`MixedPrecisionPolicy.param_dtype`, else the own).
    world_size: ranks the parameters are sharded over.
    reshard_after_forward: whether the group frees its unsharded parameters after the forward
        (False for the root, which FSDP2 keeps gathered into the backward).
    offload_to_cpu: `CPUOffloadPolicy`: the shards and their gradients live in host memory
        (`FSDPParam.offload_to_cpu`), and so does the optimizer state of their parameters.
    """

    name: str
    padded_shard_elements: int
    local_shard_elements: int
    trainable_local_elements: int
    trainable_params: int
    orig_element_bytes: int
    unsharded_element_bytes: int
    world_size: int
    reshard_after_forward: bool
    offload_to_cpu: bool = False

    @property
    def shard_bytes(self) -> int:
        """Bytes of the padded shards in the parameters' own dtype."""
        return self.padded_shard_elements * self.orig_element_bytes

    @property
    def optimizer_state_bytes(self) -> int:
        """AdamW's two moments (unpadded local shards) and step counters of the trainable parameters."""
        return ADAM_MOMENTS * self.trainable_local_elements * self.orig_element_bytes + STEP_COUNTER_BYTES * self.trainable_params

    @property
    def all_gather_output_bytes(self) -> int:
        """Bytes of the unsharded parameters (`FSDPParam.all_gather_outputs`, padded to the world size)."""
        return self.padded_shard_elements * self.world_size * self.unsharded_element_bytes


@dataclass(frozen=True)
class FsdpMemory:
    """What one rank holds under FSDP2, by kind (bytes).

    sharded_param_bytes: padded local shards of every parameter (`_sharded_param_data`).
    sharded_grad_bytes: the gradients, views of one reduce-scatter output per group (padded,
        in the parameters' own dtype), kept from the backward until `zero_grad`.
    optimizer_state_bytes: AdamW's two moments (unpadded local shards) and step counters.
    buffer_bytes: the module's buffers (not sharded).
    unsharded_param_bytes: all-gather outputs alive at the busiest moment of forward and
        backward: groups that stay gathered (the root, `reshard_after_forward=False`) plus, of
        the resharding groups, the two largest neighbours (the backward prefetches the next
        group's all-gather while the current one runs). Freed after the backward.
    step_transient_bytes: scratch of one (per-parameter) optimizer step on the device: an estimate.
    offload_copy_bytes: `CPUOffloadPolicy`: the device copy of the largest offloaded group's shards (the
        all-gather input, copied from the host) and its reduce-scatter output before it goes to the host.
    host_param_bytes, host_grad_bytes, host_optimizer_state_bytes: the same terms of the offloaded
        groups, in host memory (the optimizer steps them there); the device terms hold the others.
    """

    sharded_param_bytes: int
    sharded_grad_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    unsharded_param_bytes: int
    step_transient_bytes: int
    offload_copy_bytes: int = 0
    host_param_bytes: int = 0
    host_grad_bytes: int = 0
    host_optimizer_state_bytes: int = 0

    @property
    def host_parts(self) -> tuple[tuple[str, int], ...]:
        """(what, bytes) of every non-empty part held in host memory."""
        parts = (("parameter shards", self.host_param_bytes), ("gradient shards", self.host_grad_bytes),
                 ("optimizer state", self.host_optimizer_state_bytes))
        return tuple((what, n) for what, n in parts if n)

    @property
    def host_bytes(self) -> int:
        return sum(n for _, n in self.host_parts)

    @property
    def held_bytes(self) -> int:
        """Bytes held between steps (after `optimizer.step()`, gradients not yet zeroed), device and host."""
        device = self.sharded_param_bytes + self.sharded_grad_bytes + self.optimizer_state_bytes + self.buffer_bytes
        return device + self.host_bytes

    def to_static_memory(self) -> StaticMemory:
        """As the planner's `StaticMemory`: the unsharded parameters count as resident (the memory
        model has no forward/backward-only term: conservative by their size in the optimizer step)."""
        return StaticMemory(
            param_bytes=self.sharded_param_bytes + self.unsharded_param_bytes,
            buffer_bytes=self.buffer_bytes,
            grad_bytes=self.sharded_grad_bytes,
            optimizer_state_bytes=self.optimizer_state_bytes,
            optimizer_transient_bytes=self.step_transient_bytes,
            comm_buffer_bytes=self.offload_copy_bytes,
            grads_on_device=self.sharded_grad_bytes > 0 or not self.host_grad_bytes,
            host_parts=self.host_parts,
        )


def fsdp_memory(groups: Sequence[FsdpGroupSizes], buffer_bytes: int = 0, largest_param_bytes: int = 0) -> FsdpMemory:
    """Per-rank bytes of the groups, in the order their modules run in the forward."""
    gathered = [g.all_gather_output_bytes for g in groups if not g.reshard_after_forward]
    resharding = [g.all_gather_output_bytes for g in groups if g.reshard_after_forward]
    pairs = [a + b for a, b in itertools.pairwise(resharding)] or resharding
    kept = [g for g in groups if not g.offload_to_cpu]
    away = [g for g in groups if g.offload_to_cpu]
    return FsdpMemory(
        sharded_param_bytes=sum(g.shard_bytes for g in kept),
        sharded_grad_bytes=sum(g.shard_bytes for g in kept if g.trainable_params),
        optimizer_state_bytes=sum(g.optimizer_state_bytes for g in kept),
        buffer_bytes=buffer_bytes,
        unsharded_param_bytes=sum(gathered) + max(pairs, default=0),
        step_transient_bytes=2 * largest_param_bytes if kept else 0,  # offloaded: the optimizer steps on the host
        offload_copy_bytes=max((g.shard_bytes for g in away), default=0),
        host_param_bytes=sum(g.shard_bytes for g in away),
        host_grad_bytes=sum(g.shard_bytes for g in away if g.trainable_params),
        host_optimizer_state_bytes=sum(g.optimizer_state_bytes for g in away),
    )


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def fsdp_states(model: nn.Module) -> list[tuple[str, object]]:
    """(module path, FSDP2 state) of every `fully_shard`-ed module, in module order; [] without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [(name, m._get_fsdp_state()) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def fsdp_groups(model: nn.Module) -> list[FsdpGroupSizes]:
    """Each FSDP2 parameter group of `model` as plain sizes (after FSDP2's lazy init: the first forward)."""
    out = []
    for name, state in fsdp_states(model):
        for group in _param_groups(state):
            params = list(group.fsdp_params)
            if not params:
                continue
            policy = group.mp_policy
            orig = params[0].sharded_param.dtype
            unsharded = policy.param_dtype if policy.param_dtype is not None else orig
            trainable = [p for p in params if p.sharded_param.requires_grad]
            out.append(FsdpGroupSizes(
                name=name or "<root>",
                padded_shard_elements=sum(p.padded_sharded_param_size.numel() for p in params),
                local_shard_elements=sum(local_tensor(p.sharded_param).numel() for p in params),
                trainable_local_elements=sum(local_tensor(p.sharded_param).numel() for p in trainable),
                trainable_params=len(trainable),
                orig_element_bytes=orig.itemsize,
                unsharded_element_bytes=unsharded.itemsize,
                world_size=group.mesh_info.shard_mesh_size,
                reshard_after_forward=group.post_forward_mesh_info is not None,
                offload_to_cpu=bool(getattr(params[0], "offload_to_cpu", False)),
            ))
    return out


def model_fsdp_memory(model: nn.Module) -> FsdpMemory | None:
    """`fsdp_memory` of a live model; None when no module of it is `fully_shard`-ed."""
    groups = fsdp_groups(model)
    if not groups:
        return None
    trainable = [local_tensor(p) for p in model.parameters() if p.requires_grad]
    return fsdp_memory(
        groups,
        buffer_bytes=unique_storage_bytes(model.buffers()),
        largest_param_bytes=max((t.numel() * t.element_size() for t in trainable), default=0),
    )


def fsdp_params(model: nn.Module) -> list:
    """Every `FSDPParam` of the model's FSDP2 groups."""
    return [p for _, state in fsdp_states(model) for group in _param_groups(state) for p in group.fsdp_params]


def fsdp_host_tensors(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> list[torch.Tensor]:
    """What `CPUOffloadPolicy` keeps in host memory: the offloaded groups' padded shards, their gradients
    and the optimizer state of their parameters ([] without FSDP2 or offloading)."""
    away = [p for p in fsdp_params(model) if getattr(p, "offload_to_cpu", False)]
    if not away:
        return []
    sharded = [p.sharded_param for p in away]
    found = [p._sharded_param_data for p in away] + [g for g in (s.grad for s in sharded) if g is not None]
    ids = {id(s) for s in sharded}
    for opt in optimizers:
        for param, state in opt.state.items():
            if id(param) in ids:
                found += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return found


def fsdp_held_bytes(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> int:
    """What this rank holds now, counted on the live structures: padded shards, gradients,
    optimizer state, buffers and every all-gather output whose storage is allocated."""
    tensors: list[torch.Tensor] = []
    for p in fsdp_params(model):
        tensors.append(p._sharded_param_data)
        tensors += list(p.all_gather_outputs)
    params = list(model.parameters())
    tensors += params + list(model.buffers()) + [p.grad for p in params if p.grad is not None]
    for opt in optimizers:
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return unique_storage_bytes(tensors)
