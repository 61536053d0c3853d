"""Machine rates: measured, stored with the profile, and what the `time` metric makes of them.

No test asserts on a measured time: measured rates are checked for what they are (positive,
finite, where they belong), and every number a test reasons about comes from rates it gives."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ckpt import (
    MachineRates,
    Profile,
    StepCost,
    make_plan,
    measure_rates,
    profile_model,
)
import lightning_ckpt.profiling.machine.rates as rates_module
from lightning_ckpt.planning.recompute_cost import block_recompute, op_calls, recompute_cost, skipped_tail


class EncoderThenNorm(nn.Module):
    """Two of the example's encoder blocks, then a lone LayerNorm (like `ln_f`), then a head."""

    def __init__(self, d: int = 32, seq: int = 16) -> None:
        super().__init__()
        from train_encoder import EncoderBlock

        self.emb = nn.Embedding(50, d)
        self.blocks = nn.ModuleList([EncoderBlock(d, 4, 0.1), EncoderBlock(d, 4, 0.1), nn.LayerNorm(d)])
        self.head = nn.Linear(d, 3)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=1))


@pytest.fixture(scope="module")
def profiled():
    torch.manual_seed(0)
    model = EncoderThenNorm()
    batch = (torch.randint(0, 50, (8, 16)), torch.randint(0, 3, (8,)))

    def loss_fn(b):
        return F.cross_entropy(model(b[0]), b[1])

    return profile_model(model, list(model.blocks), loss_fn, batch, (1, 2), 4, names=["enc0", "enc1", "ln_f"])


def test_measured_rates_are_positive_finite_and_stored_in_meta(profiled):
    for probe in (*profiled.probes, profiled.check):
        rates = probe.rates
        assert rates is not None
        for value in (rates.flop_per_s, rates.mem_byte_per_s, rates.rng_byte_per_s):
            assert value > 0 and math.isfinite(value)
        for value in (rates.segment_s, rates.op_call_s, rates.keep_draws_op_s, rates.keep_ops_op_s):
            assert value >= 0 and math.isfinite(value)
        assert rates.device == "cpu" and rates.flop_dtype == rates.mem_dtype == "torch.float32"
    cost = profiled.at(8)
    assert cost.rates == profiled.probes[0].rates  # measured once, the same at every batch size
    # survives the JSON of the plan report and a checkpoint
    again = Profile.from_dict(json.loads(json.dumps(profiled.to_dict())))
    assert again.at(8).rates == cost.rates and again.at(8).blocks == cost.blocks
    assert StepCost.from_dict(json.loads(json.dumps(cost.to_dict()))).rates == cost.rates


# rates of the order `profile_model` measured on the 2-core CPU the suite runs on
GIVEN = MachineRates(flop_per_s=1.0e11, mem_byte_per_s=1.0e10, rng_byte_per_s=9.0e8, segment_s=2.5e-5, op_call_s=2.0e-5)


def test_time_metric_orders_an_encoder_block_far_above_a_lone_layer_norm(profiled):
    cost = profiled.at(8)
    enc, _, ln = cost.blocks
    assert ln.fwd_flops == 0 and block_recompute(ln, "flops") == 0  # the problem: free under flops
    assert ln.fwd_mem_bytes > 0 and enc.fwd_mem_bytes > 0 and enc.fwd_rng_bytes > 0
    t_enc, t_ln = block_recompute(enc, "time", GIVEN), block_recompute(ln, "time", GIVEN)
    assert 0 < t_ln < t_enc / 10, (t_ln, t_enc)
    # the estimate is each kind of work at its rate, and each op call its fixed cost, in milliseconds
    assert op_calls(ln) == len(ln.ops) > 0 and op_calls(enc) > 10 * op_calls(ln)
    assert t_ln == pytest.approx(1e3 * (ln.fwd_mem_bytes / GIVEN.mem_byte_per_s + op_calls(ln) * GIVEN.op_call_s))
    # a segment of it alone: its forward, less what runs after its last saved tensor, and the
    # fixed cost of one checkpoint region
    with_given = dataclasses.replace(cost, meta={**cost.meta, "rates": GIVEN.to_dict()})
    assert recompute_cost(with_given, [(2, 2)], "time") == pytest.approx(
        t_ln - skipped_tail(ln, "time", GIVEN) + 1e3 * GIVEN.segment_s
    )


def test_given_rates_are_used_as_they_are():
    torch.manual_seed(0)
    model = EncoderThenNorm()
    batch = (torch.randint(0, 50, (4, 16)), torch.randint(0, 3, (4,)))
    fixed = MachineRates(flop_per_s=1e11, mem_byte_per_s=1e10, rng_byte_per_s=1e9)

    def loss_fn(b):
        return F.cross_entropy(model(b[0]), b[1])

    prof = profile_model(model, list(model.blocks), loss_fn, batch, (1, 2), None, rates=fixed)
    assert prof.at(4).rates == fixed
    untimed = profile_model(model, list(model.blocks), loss_fn, batch, (1, 2), None, timing=False)
    assert untimed.at(4).rates is None
    with pytest.raises(ValueError, match=r"metric='time' .* this StepCost has none .* or use metric='flops'"):
        make_plan(untimed.at(4), "optimal", 10**9, metric="time")


def test_measuring_leaves_the_global_rng_alone():
    before = torch.get_rng_state()
    rates = measure_rates(repeats=1)
    assert torch.equal(torch.get_rng_state(), before)
    assert rates.flop_per_s > 0 and rates.op_call_s >= 0


def test_kernels_shrink_to_the_bytes_profiling_leaves_them_and_are_kept_apart(monkeypatch, tmp_path):
    cpu, f32 = torch.device("cpu"), torch.float32
    full = rates_module.rates_sizes(cpu, f32, f32, None)
    assert full == (512, 2**18) and rates_module.rates_bytes(full, f32, f32) == 7 * 2**20  # 2 matrices, 5 vectors
    small = rates_module.rates_sizes(cpu, f32, f32, 2**20)
    assert small[0] < full[0] and small[1] < full[1] and rates_module.rates_bytes(small, f32, f32) <= 2**20
    asked = []
    monkeypatch.setattr(rates_module, "measure_rates", lambda *a, **kw: asked.append(kw.get("sizes")) or MachineRates(1e9, 1e9, 1e9))
    monkeypatch.setenv("LIGHTNING_CKPT_CACHE_DIR", str(tmp_path))
    for max_bytes in (2**20, None, 2**20, 2**30):
        rates_module.kept_rates("cpu", max_bytes=max_bytes)
    assert asked == [small, None]  # each kept under its own key; room for the full kernels measures them whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rates_are_measured_in_the_dtypes_asked(dtype):
    rates = measure_rates(flop_dtype=dtype, mem_dtype=dtype, repeats=1)
    assert rates.flop_dtype == rates.mem_dtype == str(dtype)
    assert all(v > 0 and math.isfinite(v) for v in (rates.flop_per_s, rates.mem_byte_per_s, rates.rng_byte_per_s))


def test_each_rate_is_the_median_of_interleaved_rounds(monkeypatch):
    """An injected clock makes one round in three slow for every kernel: the median ignores it,
    the order rotates (each kernel is timed first in some round)."""
    order = []
    kernels = {name: ((lambda name=name: order.append(name)), 1e6) for name in ("flop", "mem", "rng")}
    ticks = iter(range(10**6))
    per_call = {"flop": 1e-3, "mem": 2e-3, "rng": 4e-3}

    def clock():  # every call of a kernel lasts its time; the 3rd, 6th, ... timed loop 10x that
        return next(ticks)

    def timed(fn, sync, clock):
        before = len(order)
        fn()
        name = order[-1]
        calls = len(order) - before
        timed.loops += 1
        slow = 10.0 if timed.loops % 3 == 0 else 1.0
        return per_call[name] * calls * slow

    timed.loops = 0
    monkeypatch.setattr(rates_module, "_timed", timed)
    got = rates_module._interleaved_rates(kernels, lambda: None, clock, repeats=5, min_call_s=0.0)
    assert got == pytest.approx({name: 1e6 / t for name, t in per_call.items()})
    timed_order = order[-15:]
    firsts = {timed_order[3 * r] for r in range(5)}
    assert firsts == {"flop", "mem", "rng"}


def test_one_thread_on_a_cpu_is_timed_by_its_cpu_time():
    """Which clock is chosen (the function itself): nothing is timed here."""
    cpu_clock, wall_clock = time.thread_time, time.perf_counter
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = rates_module.step_clock(torch.device("cpu"))
        torch.set_num_threads(2)
        two_threads = rates_module.step_clock(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    other_device = rates_module.step_clock(torch.device("meta"))
    assert (one_thread, two_threads, other_device) == (cpu_clock, wall_clock, wall_clock)


@pytest.mark.parametrize("field", ["flop_per_s", "mem_byte_per_s", "rng_byte_per_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_rates_must_be_positive_and_finite(field, value):
    kw = {"flop_per_s": 1e9, "mem_byte_per_s": 1e9, "rng_byte_per_s": 1e9, field: value}
    with pytest.raises(ValueError, match=rf"MachineRates: {field}=.* must be a positive finite rate"):
        MachineRates(**kw)


@pytest.mark.parametrize("name", ["segment_s", "op_call_s"])
@pytest.mark.parametrize("value", [-1e-6, math.inf, math.nan])
def test_fixed_costs_must_be_finite_and_not_negative(name, value):
    with pytest.raises(ValueError, match=rf"MachineRates: {name}=.* must be a finite number of seconds >= 0"):
        MachineRates(flop_per_s=1e9, mem_byte_per_s=1e9, rng_byte_per_s=1e9, **{name: value})


def test_rates_saved_before_the_per_call_cost_still_load():
    data = GIVEN.to_dict()
    del data["op_call_s"]
    assert MachineRates.from_dict(data) == dataclasses.replace(GIVEN, op_call_s=0.0)
