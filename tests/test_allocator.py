"""The allocator setting of a fit: glibc thresholds set and put back, the user's configuration
and other allocators left alone with a message that says what to set, CUDA's expandable segments."""

from __future__ import annotations

import pytest
import torch

from lightning_ckpt.profiling.memory import allocator
from lightning_ckpt.profiling.memory.rss import current_rss_bytes

GLIBC = allocator.is_glibc()
NO_OTHER = "7f00-7f01 r-xp 0 0 0 /usr/lib/x86_64-linux-gnu/libc.so.6\n"


@pytest.mark.parametrize(
    ("environ", "names"),
    [
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "glibc.malloc.mmap_threshold"),
    ],
)
def test_malloc_configured_by_the_user_is_left_alone(environ, names):
    setting = allocator.follow_tensors_cpu(environ=environ, maps_text=NO_OTHER, glibc=True)
    assert setting.action == "user" and names in setting.message
    setting.restore()  # nothing to undo


@pytest.mark.parametrize("name", ["jemalloc", "tcmalloc", "mimalloc"])
def test_another_allocator_gets_a_message_saying_what_to_set(name):
    maps = NO_OTHER + f"7f02-7f03 r-xp 0 0 0 /usr/lib/x86_64-linux-gnu/lib{name}.so.2\n"
    setting = allocator.follow_tensors_cpu(environ={}, maps_text=maps)
    assert (setting.action, setting.kind) == ("unsupported", name)
    assert allocator.OTHER_ALLOCATORS[name] in setting.message


def test_a_platform_without_glibc_is_told_what_to_use():
    setting = allocator.follow_tensors_cpu(environ={}, maps_text=NO_OTHER, glibc=False)
    assert setting.action == "unsupported"
    assert "not glibc" in setting.message and "MALLOC_CONF" in setting.message


def test_turned_off_does_nothing():
    setting = allocator.follow_tensors("cpu", enabled=False)
    assert (setting.action, setting.message) == ("off", "")


@pytest.mark.parametrize("enabled", [None, False])
def test_cpu_malloc_is_left_alone_unless_asked(enabled):
    """The default (None) and False leave CPU malloc as it is: its thresholds cost step time."""
    assert allocator.follow_tensors("cpu", enabled) == allocator.AllocatorSetting("off", "cpu", "")
    assert allocator.follow_tensors("cpu").action == "off"


@pytest.mark.skipif(not GLIBC or allocator.loaded_allocator() is not None, reason="glibc malloc only")
def test_cpu_malloc_is_set_when_asked(monkeypatch):
    for name in (*allocator.GLIBC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    setting = allocator.follow_tensors("cpu", True)
    try:
        assert (setting.action, setting.kind) == ("set", "glibc")
    finally:
        setting.restore()


@pytest.mark.parametrize(("enabled", "action"), [(None, "user"), (True, "user"), (False, "off")])
def test_cuda_is_set_by_default_and_when_asked(monkeypatch, enabled, action):
    """On CUDA the default sets expandable segments (here the user's configuration wins, so
    nothing touches torch); only False skips it."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert allocator.follow_tensors("cuda", enabled).action == action


@pytest.mark.skipif(not GLIBC or current_rss_bytes() is None, reason="glibc on Linux only")
def test_glibc_set_returns_freed_tensors_to_the_os_and_is_put_back():
    setting = allocator.follow_tensors_cpu(environ={}, maps_text=NO_OTHER)
    try:
        assert setting.action == "set" and "tune_allocator=None" in setting.message
        assert setting.mmap_threshold_bytes == allocator.MMAP_THRESHOLD_BYTES
        before = current_rss_bytes()
        for _ in range(3):  # glibc's dynamic threshold would keep the second one in the heap
            t = torch.ones(2 * 2**20)  # 8 MiB, touched
            del t
        assert current_rss_bytes() - before < 2 * 2**20
    finally:
        setting.restore()


def test_cuda_allocator_configured_by_the_user_is_left_alone():
    setting = allocator.follow_tensors_cuda(environ={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert setting.action == "user" and "PYTORCH_CUDA_ALLOC_CONF" in setting.message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_expandable_segments_set_and_turned_off():
    setting = allocator.follow_tensors_cuda(environ={})
    try:
        assert setting.action == "set"
        assert "expandable_segments:True" in torch._C._accelerator_getAllocatorSettings()
    finally:
        setting.restore()
    assert "expandable_segments:True" not in torch._C._accelerator_getAllocatorSettings()
