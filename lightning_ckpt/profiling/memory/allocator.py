"""Make the memory the OS or the GPU sees follow the live tensors, for the duration of a fit.

CUDA (by default): the caching allocator's `expandable_segments`. CPU, Linux with glibc, only
when asked (`tune_allocator=True`: every fresh page then costs step time): `mallopt` (through
ctypes) sets malloc's mmap and trim thresholds, so large freed tensors go back to the OS instead
of fragmenting the heap. Either only when the user has not configured the allocator.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

# glibc's <malloc.h> parameter numbers, and its defaults (DEFAULT_MMAP_THRESHOLD_MIN,
# DEFAULT_TRIM_THRESHOLD): 128 KiB each, with the mmap threshold raised dynamically up to 32 MiB
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
GLIBC_DEFAULT_THRESHOLD_BYTES = 128 * 1024
# Chosen with benchmarks/rss.py (memory vs step time per threshold; see docs/memory.md).
MMAP_THRESHOLD_BYTES = 64 * 1024
TRIM_THRESHOLD_BYTES = 64 * 1024
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
GLIBC_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
OTHER_ALLOCATORS = {
    "jemalloc": "MALLOC_CONF=dirty_decay_ms:0,muzzy_decay_ms:0 in the environment before the process starts",
    "tcmalloc": "TCMALLOC_RELEASE_RATE=10 in the environment (or call MallocExtension::ReleaseFreeMemory)",
    "mimalloc": "MIMALLOC_PURGE_DELAY=0 in the environment before the process starts",
}
CUDA_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class AllocatorSetting:
    """What was done to one allocator, and the one line that says so.

    action: ``"set"`` (changed now, `restore()` puts it back), ``"user"`` (configured by the
        user: left alone), ``"unsupported"`` (an allocator this module cannot set from inside
        the process: the message says what to set instead) or ``"off"`` (not asked).
    kind: ``"glibc"``, ``"cuda"``, the name of another allocator, or the platform.
    """

    action: str
    kind: str
    message: str
    mmap_threshold_bytes: int | None = None
    trim_threshold_bytes: int | None = None

    def restore(self) -> None:
        """Undo a ``"set"``: glibc's default thresholds (glibc has no getter and no way back to
        its dynamic threshold, so the defaults are set as fixed values), or CUDA's fixed segments."""
        if self.action != "set":
            return
        if self.kind == "glibc":
            _mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT_THRESHOLD_BYTES)
            _mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT_THRESHOLD_BYTES)
        elif self.kind == "cuda":
            _cuda_settings("expandable_segments:False")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _mallopt(param: int, value: int) -> bool:
    return bool(_libc().mallopt(ctypes.c_int(param), ctypes.c_int(value)))


def loaded_allocator(maps_text: str | None = None) -> str | None:
    """The malloc replacement mapped into this process (jemalloc, tcmalloc, mimalloc), or None."""
    if maps_text is None:
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
                maps_text = f.read()
        except OSError:
            maps_text = os.environ.get("LD_PRELOAD", "")
    for name in OTHER_ALLOCATORS:
        if f"lib{name}" in maps_text:
            return name
    return None


def _glibc_configured(environ: dict[str, str]) -> list[str]:
    found = [k for k in GLIBC_ENV if k in environ]
    tunables = environ.get("GLIBC_TUNABLES", "")
    return found + [t for t in GLIBC_TUNABLES if t in tunables]


def is_glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


def follow_tensors_cpu(
    mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES,
    environ: dict[str, str] | None = None,
    maps_text: str | None = None,
    glibc: bool | None = None,
) -> AllocatorSetting:
    """Set glibc malloc's thresholds for this process, unless the user configured malloc or
    another allocator is in use; -> what was done (`restore()` undoes it)."""
    environ = dict(os.environ) if environ is None else environ
    other = loaded_allocator(maps_text)
    if other is not None:
        return AllocatorSetting(
            "unsupported", other,
            f"lightning-ckpt: the process uses {other}, whose freed memory may stay in the process above the "
            f"budget; lightning-ckpt cannot set it from inside. Set {OTHER_ALLOCATORS[other]}.",
        )
    if not (is_glibc() if glibc is None else glibc):
        return AllocatorSetting(
            "unsupported", sys.platform,
            f"lightning-ckpt: the C allocator on {sys.platform} is not glibc, so its memory release is not set; "
            "process memory may stay above the budget after large tensors are freed. To make it follow the "
            "tensors, start the process with jemalloc and MALLOC_CONF=dirty_decay_ms:0,muzzy_decay_ms:0.",
        )
    configured = _glibc_configured(environ)
    if configured:
        return AllocatorSetting(
            "user", "glibc",
            f"lightning-ckpt: malloc is configured by the environment ({', '.join(configured)}); left as it is.",
        )
    if not (_mallopt(M_MMAP_THRESHOLD, mmap_threshold_bytes) and _mallopt(M_TRIM_THRESHOLD, trim_threshold_bytes)):
        return AllocatorSetting(
            "unsupported", "glibc",
            f"lightning-ckpt: glibc's mallopt refused mmap_threshold={mmap_threshold_bytes}; process memory may "
            "stay above the budget. Set MALLOC_MMAP_THRESHOLD_=65536 in the environment instead.",
        )
    return AllocatorSetting(
        "set", "glibc",
        f"lightning-ckpt: glibc malloc set for this fit (mmap and trim thresholds {mmap_threshold_bytes // 1024} "
        "KiB), so process memory follows the tensors; glibc's default thresholds are set back at the end. "
        "Fresh pages cost step time (x1.7 and x2.7 on this project's two CPU examples, benchmarks/rss.py): the default, "
        "tune_allocator=None, leaves malloc alone and keeps the speed at the price of RSS above the budget; "
        "preloading tcmalloc or jemalloc (LD_PRELOAD) keeps RSS nearer the tensors without most of that cost "
        "(docs/memory.md).",
        mmap_threshold_bytes, trim_threshold_bytes,
    )


def _cuda_settings(value: str) -> None:
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(value)


def follow_tensors_cuda(environ: dict[str, str] | None = None) -> AllocatorSetting:
    """Turn on the CUDA caching allocator's expandable segments unless the user configured it.

    Chosen over a fragmentation allowance learned from the profiling steps: those run at batch
    1-2, where the allocator's size classes and segment reuse differ from the target batch, so an
    allowance would be extrapolated from the wrong regime; with expandable segments the memory
    reserved stays within a 2 MiB page of the memory allocated per segment, whatever the sizes.
    """
    environ = dict(os.environ) if environ is None else environ
    configured = [k for k in CUDA_ENV if environ.get(k)]
    if configured:
        return AllocatorSetting(
            "user", "cuda", f"lightning-ckpt: the CUDA allocator is configured by {configured[0]}; left as it is."
        )
    _cuda_settings("expandable_segments:True")
    return AllocatorSetting(
        "set", "cuda",
        "lightning-ckpt: CUDA caching allocator set to expandable_segments for this fit, so reserved memory "
        "stays close to allocated memory; turned off again at the end. tune_allocator=False leaves it alone.",
    )


def follow_tensors(device_type: str, enabled: bool | None = None) -> AllocatorSetting:
    """The setting for the training device, as `tune_allocator` asks: None (the default) CUDA's
    expandable segments and nothing on CPU, where glibc's thresholds cost step time (docs/memory.md);
    True those thresholds on CPU too; False nothing anywhere."""
    if enabled is False:
        return AllocatorSetting("off", device_type, "")
    if device_type == "cuda":
        return follow_tensors_cuda()
    if device_type == "cpu" and enabled:
        return follow_tensors_cpu()
    return AllocatorSetting("off", device_type, "")
