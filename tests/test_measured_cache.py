"""Timings kept between runs: read back for the same key, measured again for another, never in the way."""

from __future__ import annotations

import json

import pytest
import torch
from models import TinyChain, tokens_batch
from torch import nn

import lightning_ckpt.apply.keep_calibration as calibration
import lightning_ckpt.profiling.machine.rates as rates_module
from lightning_ckpt.apply.keep_calibration import calibrated_profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.timing_fit import BlockTiming
from lightning_ckpt.profiling.machine import measured_cache
from lightning_ckpt.profiling.machine.measured_cache import CACHE_ENV, REMEASURE_ENV, cache_dir, kept, machine_key
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.profiling.machine.rates import kept_rates


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(REMEASURE_ENV, raising=False)
    return tmp_path


class Counting:
    def __init__(self, value: float = 1.0) -> None:
        self.calls = 0
        self.value = value

    def __call__(self) -> dict:
        self.calls += 1
        return {"x": self.value + self.calls}


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert cache_dir() == tmp_path.home() / ".cache" / "lightning_ckpt"
    for off in ("off", "0", "", "None"):
        monkeypatch.setenv(CACHE_ENV, off)
        assert cache_dir() is None
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cache_dir() == tmp_path


def test_a_kept_timing_is_read_back_for_the_same_key_only(folder):
    measure = Counting()
    assert kept("rates", {"a": 1}, measure) == {"x": 2.0}
    assert kept("rates", {"a": 1}, measure) == {"x": 2.0} and measure.calls == 1
    assert kept("rates", {"a": 2}, measure) == {"x": 3.0} and measure.calls == 2
    assert kept("other", {"a": 1}, measure) == {"x": 4.0} and measure.calls == 3  # each kind its own file
    assert sorted(p.name for p in folder.glob("*.json")) == ["other.json", "rates.json"]  # beside them: their locks


def test_remeasuring_replaces_what_was_kept(folder, monkeypatch):
    measure = Counting()
    kept("rates", {"a": 1}, measure)
    monkeypatch.setenv(REMEASURE_ENV, "1")
    assert kept("rates", {"a": 1}, measure) == {"x": 3.0}
    monkeypatch.delenv(REMEASURE_ENV)
    assert kept("rates", {"a": 1}, measure) == {"x": 3.0} and measure.calls == 2


def test_keeping_off_measures_every_time(monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    measure = Counting()
    kept("rates", {"a": 1}, measure)
    kept("rates", {"a": 1}, measure)
    assert measure.calls == 2


def test_a_damaged_or_unwritable_file_only_costs_a_measurement(folder, tmp_path, monkeypatch):
    (folder / "rates.json").write_text("{not json")
    measure = Counting()
    with pytest.warns(UserWarning, match=r"rates\.json dropped \(it is not JSON"):
        assert kept("rates", {"a": 1}, measure) == {"x": 2.0}
    assert json.loads((folder / "rates.json").read_text())  # replaced by a whole file
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked / "below"))  # a folder that cannot be made
    with pytest.warns(UserWarning, match=r"cannot keep measured timings in .*below.*measured again in every run.*"
                      r"LIGHTNING_CKPT_CACHE_DIR to a writable folder"):
        assert kept("rates", {"a": 1}, measure) == {"x": 3.0}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per folder
        assert kept("rates", {"a": 1}, measure) == {"x": 4.0}


def test_the_file_keeps_the_newest_entries_only(folder):
    for i in range(measured_cache.MAX_ENTRIES + 5):
        kept("rates", {"i": i}, lambda i=i: {"i": i})
    entries = json.loads((folder / "rates.json").read_text())
    assert len(entries) == measured_cache.MAX_ENTRIES
    assert [e["key"]["i"] for e in entries.values()] == list(range(5, measured_cache.MAX_ENTRIES + 5))


def test_the_machine_key_names_what_a_timing_depends_on():
    key = machine_key("cpu")
    assert key["torch"] == torch.__version__ and key["device"] == "cpu"
    assert key["threads"] == torch.get_num_threads() and key["device_name"]


def test_rates_are_measured_once_per_dtype(folder, monkeypatch):
    calls: list = []

    def fake(device, flop_dtype, mem_dtype):
        calls.append((flop_dtype, mem_dtype))
        return MachineRates(flop_per_s=1e10 + len(calls), mem_byte_per_s=1e9, rng_byte_per_s=1e8, op_call_s=1e-6)

    monkeypatch.setattr(rates_module, "measure_rates", fake)
    first = kept_rates("cpu", torch.float32, torch.float32)
    assert kept_rates("cpu", "torch.float32", "torch.float32") == first and len(calls) == 1
    assert kept_rates("cpu", torch.bfloat16, torch.bfloat16).flop_per_s == 1e10 + 2 and len(calls) == 2
    assert first == MachineRates(flop_per_s=1e10 + 1, mem_byte_per_s=1e9, rng_byte_per_s=1e8, op_call_s=1e-6)


def _loss(model):
    return lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1])


def profiled_chain(n_blocks: int, d: int, batch: int, seq: int):
    """A dropout chain profiled at given rates, without the calibration -> (model, batch, rates, profile)."""
    torch.manual_seed(0)
    model = TinyChain(n_blocks=n_blocks, d=d, p=0.1)
    data = tokens_batch(batch=batch, seq=seq)
    given = MachineRates(flop_per_s=1e10, mem_byte_per_s=1e9, rng_byte_per_s=1e8, segment_s=1e-5, op_call_s=1e-6)
    profile = profile_model(model, list(model.blocks), _loss(model), data, (2, 4), min(8, batch), rates=given, calibrate_keeps=False)
    return model, data, given, profile


def test_a_calibration_is_kept_for_the_same_blocks_batch_and_rates(folder, monkeypatch):
    model, batch, given, profile = profiled_chain(n_blocks=3, d=16, batch=8, seq=6)
    measured: list = []

    def measure_block(*args, **kwargs):
        measured.append(1)
        return BlockTiming(all_ms=5.0 + len(measured), draws_ms=2.0, noise_ms=1.0, recompute_ms=15.0, rounds=5,
                           part_keys=(("aten.mm.default", 0),), part_ms=1.5)

    monkeypatch.setattr(calibration, "measure_block", measure_block)
    monkeypatch.setattr(calibration, "measure_keep_overheads", lambda device: (2e-6, 3e-6))
    first = calibrated_profile(profile, model, list(model.blocks), _loss(model), batch)
    n = len(measured)
    assert n >= 1
    again = calibrated_profile(profile, model, list(model.blocks), _loss(model), batch)
    assert len(measured) == n  # read back, not measured
    assert again.at(8).blocks == first.at(8).blocks and again.at(8).rates == first.at(8).rates
    # another batch size is another calibration
    calibrated_profile(profile, model, list(model.blocks), _loss(model), tokens_batch(batch=6, seq=6))
    assert len(measured) > n


def test_a_large_file_of_other_machines_and_torch_versions_is_trimmed_when_read(folder):
    from lightning_ckpt.profiling.machine.measured_cache import _digest

    here = {**machine_key("cpu"), "what": "rates"}
    entries = {}
    for i in range(20_000):  # other torch versions and other machines, as a shared home collects them over years
        other = {**here, "torch": f"1.{i % 13}.0", "what": i} if i % 2 else {**here, "cpus": 1000 + i, "what": i}
        entries[_digest(other)] = {"key": other, "value": {"x": float(i)}}
    entries[_digest(here)] = {"key": here, "value": {"x": -1.0}}
    path = folder / "rates.json"
    path.write_text(json.dumps(entries))
    assert path.stat().st_size > 2_000_000
    measure = Counting()
    assert kept("rates", here, measure) == {"x": -1.0}  # this machine's entry is read back, not measured
    assert measure.calls == 0
    trimmed = json.loads(path.read_text())
    assert [e["key"] for e in trimmed.values()] == [json.loads(json.dumps(here))]
    assert path.stat().st_size < 2_000
