"""Kept timings heal themselves: a damaged entry is dropped with one warning naming the file, measured
again and the file rewritten without it; writers at once lose no entry."""

from __future__ import annotations

import json
import math
import threading
import warnings

import pytest
import torch
from test_measured_cache import profiled_chain
from torch import nn

import lightning_ckpt.apply.keep_calibration as calibration
import lightning_ckpt.profiling.machine.rates as rates_module
from lightning_ckpt.apply.keep_calibration import calibrated_profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.timing_fit import BlockTiming
from lightning_ckpt.profiling.machine import measured_cache
from lightning_ckpt.profiling.machine.measured_cache import CACHE_ENV, REMEASURE_ENV, kept
from lightning_ckpt.profiling.machine.rates import kept_rates


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(REMEASURE_ENV, raising=False)
    return tmp_path


@pytest.fixture
def measured(monkeypatch) -> list:
    """`measure_rates` replaced: each call a little faster than the one before, and counted."""
    calls: list = []

    def fake(device, flop_dtype, mem_dtype):
        calls.append(1)
        return MachineRates(flop_per_s=1e10 + len(calls), mem_byte_per_s=1e9, rng_byte_per_s=1e8, op_call_s=1e-6)

    monkeypatch.setattr(rates_module, "measure_rates", fake)
    return calls


def _damage(path, change) -> None:
    entries = json.loads(path.read_text())
    (digest,) = entries
    change(entries, digest)
    path.write_text(json.dumps(entries))  # NaN is written as JSON's NaN, which reads back


def _set_value(field, value):
    def change(entries, digest):
        entries[digest]["value"][field] = value

    return change


def _drop_field(entries, digest):
    del entries[digest]["value"]["mem_byte_per_s"]


def _whole_entry(value):
    def change(entries, digest):
        entries[digest] = value

    return change


def _extra_entry_field(entries, digest):
    entries[digest]["measured_by"] = "someone"


def _moved_entry(entries, digest):
    entries["0" * 32] = entries.pop(digest)


DAMAGE = {
    "null rate": _set_value("flop_per_s", None),
    "zero rate": _set_value("flop_per_s", 0),
    "NaN rate": _set_value("mem_byte_per_s", math.nan),
    "infinite seconds": _set_value("op_call_s", math.inf),
    "negative seconds": _set_value("segment_s", -1e-6),
    "bool rate": _set_value("rng_byte_per_s", True),
    "text rate": _set_value("flop_per_s", "fast"),
    "number device": _set_value("device", 0),
    "missing field": _drop_field,
    "extra field": _set_value("turbo", 2.0),
    "null entry": _whole_entry(None),
    "null value": lambda entries, digest: entries[digest].update(value=None),
    "list entry": _whole_entry([1, 2]),
    "extra entry field": _extra_entry_field,
    "entry under another digest": _moved_entry,
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_rate_entry_is_measured_again_and_the_file_healed(folder, measured, damage):
    first = kept_rates("cpu")
    path = folder / "rates.json"
    _damage(path, damage)
    with pytest.warns(UserWarning, match=rf"1 damaged entry of the kept timings in {path} dropped") as record:
        again = kept_rates("cpu")
    assert len([w for w in record if "lightning-ckpt" in str(w.message)]) == 1
    assert len(measured) == 2 and again.flop_per_s == first.flop_per_s + 1
    (entry,) = json.loads(path.read_text()).values()
    assert MachineRates.from_dict(entry["value"]) == again  # healed: the new measurement in place of the bad one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kept_rates("cpu") == again and len(measured) == 2  # read back, nothing more to say


def test_a_damaged_entry_of_another_key_is_dropped_while_the_good_one_is_read(folder, measured):
    good = kept_rates("cpu")
    kept_rates("cpu", torch.bfloat16, torch.bfloat16)
    path = folder / "rates.json"
    entries = json.loads(path.read_text())
    bf16 = next(d for d, e in entries.items() if e["key"]["flop_dtype"] == "torch.bfloat16")
    entries[bf16]["value"]["flop_per_s"] = False
    path.write_text(json.dumps(entries))
    with pytest.warns(UserWarning, match=rf"in {path} dropped \(entry '{bf16}': flop_per_s=False is not a finite number"):
        assert kept_rates("cpu") == good
    assert len(measured) == 2  # the good entry was read, nothing measured
    assert list(json.loads(path.read_text())) == [d for d in entries if d != bf16]


def test_a_measured_value_its_reader_refuses_is_returned_but_not_kept(folder):
    def positive(value):
        if not value["x"] > 0:
            raise ValueError(f"x={value['x']!r} is not positive")

    assert kept("odd", {"a": 1}, lambda: {"x": -1.0}, check=positive) == {"x": -1.0}
    assert not (folder / "odd.json").exists()
    assert kept("odd", {"a": 1}, lambda: {"x": 2.0}, check=positive) == {"x": 2.0}
    assert kept("odd", {"a": 1}, lambda: {"x": 3.0}, check=positive) == {"x": 2.0}


def _loss(model):
    return lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1])


CALIBRATION_DAMAGE = {
    "bool noise": ("noise_ms", True),
    "NaN saving": ("all_ms", math.nan),
    "fractional rounds": ("rounds", 2.5),
    "text recompute": ("recompute_ms", "slow"),
    "bad part keys": ("part_keys", [["aten.mm.default"]]),
    "extra field": ("speedup", 1.0),
}


@pytest.mark.parametrize("field, value", CALIBRATION_DAMAGE.values(), ids=CALIBRATION_DAMAGE.keys())
def test_a_damaged_calibration_is_measured_again_and_the_file_healed(folder, monkeypatch, field, value):
    model, batch, given, profile = profiled_chain(n_blocks=2, d=8, batch=4, seq=4)
    measured: list = []

    def measure_block(*args, **kwargs):
        measured.append(1)
        return BlockTiming(all_ms=5.0, draws_ms=2.0, noise_ms=1.0, recompute_ms=15.0, rounds=5,
                           part_keys=(("aten.mm.default", 0),), part_ms=1.5)

    monkeypatch.setattr(calibration, "measure_block", measure_block)
    monkeypatch.setattr(calibration, "measure_keep_overheads", lambda device: (2e-6, 3e-6))
    first = calibrated_profile(profile, model, list(model.blocks), _loss(model), batch)
    n = len(measured)
    path = folder / "keep_calibration.json"
    entries = json.loads(path.read_text())
    (digest,) = entries
    original = json.loads(json.dumps(entries[digest]["value"]))
    timing = next(iter(entries[digest]["value"]["timings"].values()))
    timing[field] = value
    path.write_text(json.dumps(entries))
    with pytest.warns(UserWarning, match=rf"1 damaged entry of the kept timings in {path} dropped"):
        again = calibrated_profile(profile, model, list(model.blocks), _loss(model), batch)
    assert len(measured) == 2 * n and again.at(4).blocks == first.at(4).blocks
    assert json.loads(path.read_text())[digest]["value"] == original  # measured again (the same fakes): healed


def test_writers_at_once_lose_no_entry(folder, monkeypatch):
    """Both writers read the file before either writes (the barrier), and each writes slowly: only
    the lock with the read-merge-write under it keeps both entries."""
    both_read = threading.Barrier(2, timeout=30)
    write = measured_cache._write

    def slow_write(path, entries):
        threading.Event().wait(0.2)  # the other writer runs meanwhile
        write(path, entries)

    monkeypatch.setattr(measured_cache, "_write", slow_write)
    errors: list = []

    def writer(name: str) -> None:
        def measure() -> dict:
            both_read.wait()
            return {"by": name}

        try:
            kept("rates", {"writer": name}, measure)
        except Exception as err:  # told by the assert below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    entries = json.loads((folder / "rates.json").read_text())
    assert sorted(e["value"]["by"] for e in entries.values()) == ["a", "b"]
