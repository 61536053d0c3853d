"""`lifetimes.held_rise`: the peak over a window with some storages kept alive, against the measured one.
`lifetimes.is_local`: which storages the per-block fields of their block and the next one describe."""

from __future__ import annotations

import pytest

from lightning_ckpt.profiling.memory.lifetimes import StorageLedger, block_region, gap_region, held_rise, is_local


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


def _output_of_block_0(passed: bool, freed_in: int) -> bool:
    """Block 0's output in a chain of 3: passed to block 1 as its input or not, freed in region `freed_in`."""
    led = StorageLedger()
    led.region = block_region(0)
    led.born("out", 8)
    if passed:
        led.passed(["out"], 1)
    led.region = freed_in
    led.freed("out")
    return is_local(led, 0, 3)


@pytest.mark.parametrize(
    ("passed", "freed_in", "local"),
    [
        (True, gap_region(2), True),  # `x = block(x)`: block 1's input, freed just after it
        (False, gap_region(1), True),  # freed in the gap, before block 1 starts
        (False, block_region(1), False),  # alive at block 1's entry, not its input: no field of block 1 holds it
        (False, gap_region(2), False),  # a local of the module around them holds it beside block 1 (a copy is its input)
    ],
)
def test_an_output_alive_beside_the_next_block_without_being_its_input_is_carried(passed, freed_in, local):
    assert _output_of_block_0(passed, freed_in) is local
