"""Process memory (resident set size) on Linux: its value now and its peak since a reset.

The kernel keeps the peak itself (VmHWM in /proc/self/status) and writing "5" to
/proc/self/clear_refs resets it to the current RSS, so the peak of a step is exact, with no
sampling. Where that file cannot be written, a thread samples /proc/self/statm every millisecond.
The anonymous part (heap and mmapped tensors, without library code paged in) is given apart.
`available_host_bytes` reads what the whole machine could still give (MemAvailable in /proc/meminfo).
"""

from __future__ import annotations

import os
import threading
from typing import Any

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SAMPLE_SECONDS = 0.001


def current_rss_bytes() -> int | None:
    """This process's RSS now; None where /proc is not available (not Linux)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def available_host_bytes() -> int | None:
    """Host memory available to new allocations without swapping (MemAvailable); None where unreadable."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _status_bytes(*keys: str) -> int | None:
    """The sum of these /proc/self/status fields (kB) in bytes; None when unreadable."""
    found = 0
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.split(":")[0] in keys:
                    found += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return found


def _hwm_bytes() -> int | None:
    return _status_bytes("VmHWM")


def current_anon_bytes() -> int | None:
    """The anonymous part of the RSS now (RssAnon): heap, mmapped tensors, stacks."""
    return _status_bytes("RssAnon")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssPeak:
    """Context manager: `peak_bytes` is the largest RSS while it was open (None without /proc).

    `method` says how: ``"hwm"`` (kernel high-water mark, reset on entry) or ``"sampled"``.
    `anon_peak_bytes` is the anonymous part: the peak less the file-backed and shared pages at
    exit (library code paged in by first calls, which never shrinks within a step).
    """

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self.anon_peak_bytes: int | None = None
        self.method = "none"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampled = 0

    def __enter__(self) -> RssPeak:
        if current_rss_bytes() is None:
            return self
        if _reset_hwm() and _hwm_bytes() is not None:
            self.method = "hwm"
            return self
        self.method = "sampled"
        self._sampled = current_rss_bytes() or 0
        self._thread = threading.Thread(target=self._sample, name="lightning-ckpt-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._sampled = max(self._sampled, current_rss_bytes() or 0)

    def __exit__(self, *exc: Any) -> None:
        if self.method == "hwm":
            self.peak_bytes = _hwm_bytes()
        elif self.method == "sampled":
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self._sampled, current_rss_bytes() or 0)
        mapped = _status_bytes("RssFile", "RssShmem")
        if self.peak_bytes is not None and mapped is not None:
            self.anon_peak_bytes = self.peak_bytes - mapped
