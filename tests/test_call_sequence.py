"""`record_calls` reads the calls of a training step's forward and what their ops save, with nothing
saved for backward: the forward holds no more than a forward without autograd (the storages it counts
die as they would there), measured by glibc's own heap count (`malloc_oracle`), and each saved storage
is counted once while it lives, also when a later one takes its address."""

from __future__ import annotations

import gc

import torch
from malloc_oracle import MallocPeak, heap_in_use_bytes
from torch import nn

from lightning_ckpt.profiling.structure.call_sequence import record_calls

MiB = 2**20


class _Deep(nn.Module):
    """Blocks that each save about 3 MiB at the batch below (the linear's input, GELU's input, the product)."""

    def __init__(self, n: int = 12, width: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * x
        return x.square().mean()


def _heap_rise(fn) -> int:
    gc.collect()
    start = heap_in_use_bytes()
    with MallocPeak() as peak:
        fn()
    return peak.peak_bytes - start


def test_reading_the_calls_holds_no_more_than_a_forward_without_autograd():
    torch.manual_seed(0)
    model = _Deep()
    x = torch.randn(1024, 256)
    seq = record_calls(model, model, x)
    saved = seq.step_saved_bytes
    assert saved >= (12 * 3 - 1) * MiB  # every block's saved bytes counted (the batch is not), as a backward holds them
    with torch.no_grad():
        plain = _heap_rise(lambda: model(x))
    reading = _heap_rise(lambda: record_calls(model, model, x))
    assert reading <= plain + 2 * MiB, (reading / MiB, plain / MiB)
    assert reading < saved / 4


def test_a_storage_at_the_address_of_a_dead_one_counts_again():
    """Two calls each save a tensor that dies right after them; the second may take the first's address:
    both are counted."""

    class _Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            h = self.a(x.exp()).sum()  # the linear saves its 64 KiB input, which dies after this line
            return h + self.b(x.exp()).sum()

    model = _Twice()
    x = torch.randn(256, 64)
    seq = record_calls(model, model, x)
    exp_bytes = 256 * 64 * 4
    by_path = {c.path: c for c in seq.calls}
    assert by_path["a"].own_saved_bytes == by_path["b"].own_saved_bytes == exp_bytes
    assert seq.step_saved_bytes == 2 * exp_bytes
