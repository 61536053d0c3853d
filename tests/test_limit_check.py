"""The tracker's limit stops an op before it runs when its results would take what is held over it: the
bound read from shapes (pointwise broadcast, matrix products, lookups, factories) decides when the op is
first run on the meta device; a live-storage count of the test's own (`storage_oracle`) never sees it."""

from __future__ import annotations

import pytest
import torch
from storage_oracle import LiveStorages

from lightning_ckpt.profiling.memory.limit_check import bound_bytes, result_bytes
from lightning_ckpt.profiling.memory.tracker import LiveBytesOverLimit, LiveBytesTracker

aten = torch.ops.aten


def test_the_bound_reads_what_an_op_makes_from_shapes():
    col, row = torch.ones(64, 1), torch.ones(1, 64)
    assert bound_bytes(aten.mul.Tensor, [col, row]) == 64 * 64 * 4  # the broadcast
    assert bound_bytes(aten.mm.default, [col, row]) == 64 * 64 * 4  # rows by columns
    ids, weight = torch.zeros(100, dtype=torch.long), torch.ones(10, 8)
    assert bound_bytes(aten.embedding.default, [weight, ids]) == 100 * 8 * 4
    assert bound_bytes(aten.cat.default, [col, col]) == 2 * 64 * 4
    assert bound_bytes(aten.ones.default, []) is None  # a factory: always checked on the meta device
    assert result_bytes(aten.mm.default, (col, row), None) == 64 * 64 * 4
    assert result_bytes(aten.view.default, (col, [64]), None) == 0  # an input's storage


def test_an_op_whose_result_would_go_over_the_limit_is_stopped_before_it_runs():
    tracker = LiveBytesTracker()
    tracker.limit_bytes = 4096
    with LiveStorages() as oracle:
        with tracker:
            col, row = torch.ones(64, 1), torch.ones(1, 64)  # 512 B
            with pytest.raises(LiveBytesOverLimit, match=r"reached 16896 before an op made a storage of 16384 bytes"):
                torch.mul(col, row)
            with pytest.raises(LiveBytesOverLimit) as err:
                torch.ones(64, 64)
            kept = torch.mul(col[:8], row)  # 2 KiB: within the limit
    assert err.value.reached_bytes == 512 + 16384 and err.value.limit_bytes == 4096
    assert kept.shape == (8, 64) and oracle.peak <= 4096
