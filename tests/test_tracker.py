"""The live-storage helpers on tensors whose storage is gone or not their own (FSDP2's cases)."""

from __future__ import annotations

import torch

from lightning_ckpt.profiling.memory.tracker import (
    LiveBytesTracker,
    local_tensor,
    storage_bytes,
    storage_key,
    unique_storage_bytes,
)


class Wrapper(torch.Tensor):
    """A wrapper subclass without data of its own, like a DTensor: its bytes are in `_local_tensor`."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, global_shape: tuple[int, ...]):
        out = torch.Tensor._make_wrapper_subclass(cls, global_shape, dtype=local.dtype)
        out._local_tensor = local
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not needed here")


def test_storage_resized_to_zero_is_absent():
    """FSDP2 frees unsharded parameters by resizing their storage to 0 bytes."""
    t = torch.ones(64)
    key = storage_key(t)
    assert key is not None and storage_bytes(t) == 256
    t.untyped_storage().resize_(0)
    assert storage_key(t) is None and storage_bytes(t) == 0 and unique_storage_bytes([t]) == 0


def test_wrapper_subclass_counts_its_local_tensor():
    """The wrapper's own storage is an invalid python storage (touching its data pointer raises):
    it is counted by its local shard, once, together with other views of that shard."""
    local = torch.zeros(8, 4)
    wrapped = Wrapper(local, (16, 4))
    assert local_tensor(wrapped) is local and local_tensor(local) is local
    assert storage_key(wrapped) == storage_key(local)
    assert storage_bytes(wrapped) == 128
    assert unique_storage_bytes([wrapped, local, local[1:]]) == 128
    tracker = LiveBytesTracker()
    tracker.adopt([wrapped, local])
    assert tracker.live_bytes == 128


def test_the_step_tracker_counts_a_training_step_as_the_general_tracker_does():
    """Read by op schema only (views and in-place results skipped, inputs never read), a whole AdamW step of
    a chain with the model's state adopted peaks where the general tracker peaks, through every step; a view
    or an in-place op makes nothing new."""
    from models import TinyChain, tokens_batch

    from lightning_ckpt.profiling.memory.step_peak import state_tensors
    from lightning_ckpt.profiling.memory.tracker import StepBytesTracker

    torch.manual_seed(0)
    model = TinyChain(n_blocks=3, d=16)
    opt = torch.optim.AdamW(model.parameters())
    tokens, labels = tokens_batch(4, 12)
    peaks = []
    for kind in (LiveBytesTracker, StepBytesTracker) * 2:  # the first step makes AdamW's state
        with kind() as tracker:
            tracker.adopt(state_tensors(model, opt) + [tokens, labels])
            tracker.reset_peak()
            loss = torch.nn.functional.cross_entropy(model(tokens), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        peaks.append(tracker.peak_bytes)
    assert peaks[2] == peaks[3] and peaks[0] < peaks[1] == peaks[2]
    x = torch.ones(256)
    with StepBytesTracker() as tracker:
        tracker.adopt([x])
        x.view(16, 16).t().add_(1)
        x.mul_(2).clamp_(max=5)
        assert tracker.live_bytes == 1024
        y = x * 2
        assert tracker.live_bytes == 2048 and y.untyped_storage().nbytes() == 1024
