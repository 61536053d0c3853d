"""Process RSS now and its peak over a block of code, from the kernel's high-water mark or sampled."""

from __future__ import annotations

import mmap
import time

import pytest

from lightning_ckpt.profiling.memory import rss

pytestmark = pytest.mark.skipif(rss.current_rss_bytes() is None, reason="needs /proc (Linux)")
MIB = 2**20


def _touched(nbytes: int) -> mmap.mmap:
    """Fresh pages from the kernel, touched one by one: not through malloc, whose settings (and the
    free memory it kept from earlier tests in this process) could hand back pages already resident."""
    fresh = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        fresh[offset] = 1
    return fresh


def test_current_rss_is_positive_and_sees_a_touched_allocation():
    before = rss.current_rss_bytes()
    fresh = _touched(64 * MIB)
    assert before > 0 and rss.current_rss_bytes() - before >= 60 * MIB
    fresh.close()


@pytest.mark.parametrize("writable", [True, False])
def test_peak_covers_a_tensor_freed_inside(monkeypatch, writable):
    if not writable:
        monkeypatch.setattr(rss, "_reset_hwm", lambda: False)  # as where clear_refs is not writable
    with rss.RssPeak() as peak:
        start = rss.current_rss_bytes()
        fresh = _touched(64 * MIB)  # fresh pages (see above), freed before the block ends
        time.sleep(0.05)  # long enough for the sampler
        fresh.close()
    assert peak.method == ("hwm" if writable else "sampled")
    assert peak.peak_bytes - start >= 60 * MIB
    assert peak.peak_bytes < start + 200 * MIB
    assert peak.anon_peak_bytes is not None and 0 < peak.anon_peak_bytes <= peak.peak_bytes
