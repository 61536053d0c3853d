"""benchmarks/startup.py's phase clock: each phase's time leaves out the phases inside it, a sticky
phase keeps everything inside it, and `install` wraps a function wherever a module holds it."""

from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import startup  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def run(self, seconds: float) -> None:
        self.now += seconds


def test_phases_are_exclusive_and_a_sticky_one_takes_all(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(startup.time, "perf_counter", clock)
    phases = startup.PhaseClock()
    rates = phases.wrap(lambda: clock.run(2), "rates")
    planning = phases.wrap(lambda: clock.run(5), "planning")

    def probe():
        clock.run(1)
        rates()
        clock.run(3)

    def report():
        clock.run(1)
        planning()  # inside the report: counted as the report's

    phases.wrap(probe, "probes")()
    phases.wrap(report, "report")()
    planning()
    assert phases.totals == {"probes": 4.0, "rates": 2.0, "report": 6.0, "planning": 5.0}
    assert phases.calls == {"probes": 1, "rates": 1, "report": 1, "planning": 1}


def test_install_wraps_every_module_that_holds_the_function(monkeypatch):
    def target():
        return 7

    home = types.ModuleType("lightning_ckpt._startup_home")
    home.target = target
    user = types.ModuleType("lightning_ckpt._startup_user")
    user.target = target
    monkeypatch.setitem(sys.modules, home.__name__, home)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    monkeypatch.setattr(startup, "PATCHES", ((home.__name__, "target", "probes"), ("lightning_ckpt.nowhere", "f", "rates")))
    phases = startup.PhaseClock()
    startup.install(phases)
    assert home.target is user.target and home.target is not target and home.target.__wrapped__ is target
    assert user.target() == 7 and phases.calls == {"probes": 1}
