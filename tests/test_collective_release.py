"""`collective_release`: a functional collective run by `call_op` is waited for where it is issued, and
its tensors are let go of by gloo's thread before the op returns, so a tracker sees them freed by the step."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from lightning_ckpt.profiling.memory.collective_release import call_op, is_issued_collective
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker, StepBytesTracker

_c10d = torch.ops._c10d_functional


@contextlib.contextmanager
def one_rank_gloo():
    """A gloo process group of one rank in this process (its collectives run on gloo's threads)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; this test needs it free")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def test_which_ops_issue_a_collective():
    assert is_issued_collective(_c10d.all_reduce.default)
    assert is_issued_collective(_c10d.all_gather_into_tensor.default)
    assert not is_issued_collective(_c10d.wait_tensor.default)
    assert not is_issued_collective(torch.ops.aten.add.Tensor)


def test_other_ops_run_as_they_are():
    x = torch.arange(4.0)
    assert torch.equal(call_op(torch.ops.aten.mul.Tensor, (x, x), None), x * x)


def test_collective_done_and_let_go_when_the_op_returns():
    with one_rank_gloo() as group:
        for _ in range(20):
            x = torch.full((1024,), 3.0)
            y = call_op(_c10d.all_reduce.default, (x, "sum", group), {})
            # issued plainly, the work holds `y` (registered until its wait) and gloo's thread holds that work
            assert y._use_count() == 1 and torch._C._storage_Use_Count(y.untyped_storage()._cdata) == 2
            assert x._use_count() == 1
            assert _c10d.wait_tensor(y) is y and torch.equal(y, x)  # the step's own wait finds it done
            z = call_op(_c10d.all_gather_into_tensor.default, (y[:8], 1, group), {})
            assert z._use_count() == 1 and torch.equal(z, torch.full((8,), 3.0))


@pytest.mark.parametrize("tracker", [LiveBytesTracker, StepBytesTracker])
def test_tracker_sees_the_output_freed_by_the_step(tracker):
    with one_rank_gloo() as group:
        x = torch.ones(4096)
        with tracker() as t:
            for _ in range(50):
                y = _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))
                assert t.live_bytes == 4096 * 4
                del y
                # freed by the step: at once as a rule; rarely gloo's thread frees it a moment later (the
                # references `call_op` can see are gone by then), so the tracker is given that moment
                deadline = time.monotonic() + 5.0
                while t.live_bytes and time.monotonic() < deadline:
                    time.sleep(1e-3)
                assert t.live_bytes == 0
