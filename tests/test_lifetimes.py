"""`lifetimes.held_rise`: the peak over a window with some storages kept alive, against the measured one."""

from __future__ import annotations

from lightning_ckpt.profiling.lifetimes import StorageLedger, held_rise


def _ledger() -> StorageLedger:
    led = StorageLedger()
    led.born("mask", 8)  # tick 1: made before the window, freed inside it (tick 3)
    t0 = led.mark()
    led.born("a", 4)  # tick 2
    led.freed("mask")  # tick 3
    led.born("b", 10)  # tick 4: the peak, 6 above the start as measured (the mask gone), 14 with it held
    led.freed("a")  # tick 5
    led.freed("b")  # tick 6
    return led, t0


def test_held_rise_counts_a_held_storage_freed_before_the_peak():
    led, t0 = _ledger()
    assert held_rise(led, t0, led.mark(), set()) == 0
    assert held_rise(led, t0, led.mark(), {0}) == 14 - 6


def test_held_rise_ignores_deaths_after_the_window():
    led, t0 = _ledger()
    assert held_rise(led, t0, 2, {0}) == 0  # the window ends before the mask is freed
