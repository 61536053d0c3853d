"""The bytes `DistributedDataParallel` holds for its gradient buckets: allocated once, when DDP wraps the
module, so neither the unwrapped model nor a tracker started at a step sees them.

DDP's reducer keeps one flat tensor per bucket with a slot for every gradient it all-reduces (the
trainable parameters it does not ignore). Measured on 2 CPU ranks with gloo (`tests/test_ddp_memory.py`),
under Lightning's `zero_grad(set_to_none=True)`:

- `gradient_as_bucket_view=False` (DDP's and Lightning's default): the gradients are separate tensors and
  the buckets a copy of them, resident all step: every phase of every step holds the bucket bytes above
  the same model without DDP (within 1 KiB).
- `gradient_as_bucket_view=True`: after a backward the gradients are views into the buckets, so between
  steps nothing is added; but the buckets stay allocated while the gradients are None, so the first
  forward and the start of every backward hold them on top of the model. Counting them as resident is
  exact there and high by at most the gradients elsewhere (the later forwards, the rest of each
  backward, the optimizer step).

Either way the step where DDP rebuilds its buckets (the 2nd; the 3rd with `static_graph`) allocates the
new ones before the old ones are gone, and the old ones may stay alive into it (about one run in three
here): one bucket above what is counted, in that one step. Both settings count `bucket_bytes` as
resident (`StaticMemory.comm_buffer_bytes`), taken from the reducer's own record
(`_get_ddp_logging_data()`, the rebuilt buckets once rebuilt), else from the gradients DDP reduces.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ddp_bucket_bytes", "ddp_comm_buffer_bytes", "find_ddp"]


def find_ddp(module: object) -> DistributedDataParallel | None:
    """The first `DistributedDataParallel` in `module`'s tree, wrappers first: Lightning's `trainer.model`
    is one, Fabric's `_FabricModule` holds one as its `_forward_module`."""
    if not isinstance(module, nn.Module):
        return None
    for m in module.modules():
        if isinstance(m, DistributedDataParallel):
            return m
    return None


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.replace(",", " ").split()]


def ddp_bucket_bytes(ddp: DistributedDataParallel) -> int:
    """Bytes of `ddp`'s gradient buckets, as its reducer allocated them."""
    try:
        data = ddp._get_ddp_logging_data()
    except (AttributeError, AssertionError, RuntimeError):  # a private API: fall back to the gradients
        data = {}
    recorded = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    if isinstance(recorded, str) and recorded.strip():
        return sum(_sizes(recorded))
    return sum(
        p.numel() * p.element_size()
        for p in ddp.module.parameters()
        if p.requires_grad and not getattr(p, "_ddp_ignored", False)
    )


def ddp_comm_buffer_bytes(module: object) -> int:
    """Resident bytes DDP adds to the static memory of the model it wraps (see the module docstring);
    0 when no `DistributedDataParallel` wraps it."""
    ddp = find_ddp(module)
    return 0 if ddp is None else ddp_bucket_bytes(ddp)
