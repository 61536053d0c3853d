"""Machine rates: measured, stored with the profile, and what the `time` metric makes of them."""

from __future__ import annotations

import json
import math

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
from lightning_ckpt.planning.recompute_cost import block_recompute, recompute_cost


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
        assert rates.device == "cpu" and rates.flop_dtype == rates.mem_dtype == "torch.float32"
    cost = profiled.at(8)
    assert cost.rates == profiled.probes[0].rates  # measured once, the same at every batch size
    # survives the JSON of the plan report and a checkpoint
    again = Profile.from_dict(json.loads(json.dumps(profiled.to_dict())))
    assert again.at(8).rates == cost.rates and again.at(8).blocks == cost.blocks
    assert StepCost.from_dict(json.loads(json.dumps(cost.to_dict()))).rates == cost.rates


def test_time_metric_orders_an_encoder_block_far_above_a_lone_layer_norm(profiled):
    cost = profiled.at(8)
    enc, _, ln = cost.blocks
    assert ln.fwd_flops == 0 and block_recompute(ln, "flops") == 0  # the problem: free under flops
    assert ln.fwd_mem_bytes > 0 and enc.fwd_mem_bytes > 0 and enc.fwd_rng_bytes > 0
    rates = cost.rates
    t_enc, t_ln = block_recompute(enc, "time", rates), block_recompute(ln, "time", rates)
    assert 0 < t_ln < t_enc / 20, (t_ln, t_enc)
    # the estimate is each kind of work at its rate, in milliseconds
    assert t_ln == pytest.approx(1e3 * ln.fwd_mem_bytes / rates.mem_byte_per_s)
    # a segment of it alone: its forward (nothing after its last saved tensor) and the
    # fixed cost of one checkpoint region
    assert recompute_cost(cost, [(2, 2)], "time") == pytest.approx(t_ln + 1e3 * rates.segment_s)


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
    assert rates.flop_per_s > 0


@pytest.mark.parametrize("field", ["flop_per_s", "mem_byte_per_s", "rng_byte_per_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_rates_must_be_positive_and_finite(field, value):
    kw = {"flop_per_s": 1e9, "mem_byte_per_s": 1e9, "rng_byte_per_s": 1e9, field: value}
    with pytest.raises(ValueError, match=rf"MachineRates: {field}=.* must be a positive finite rate"):
        MachineRates(**kw)


@pytest.mark.parametrize("value", [-1e-6, math.inf, math.nan])
def test_segment_overhead_must_be_finite_and_not_negative(value):
    with pytest.raises(ValueError, match=r"MachineRates: segment_s=.* must be a finite number of seconds >= 0"):
        MachineRates(flop_per_s=1e9, mem_byte_per_s=1e9, rng_byte_per_s=1e9, segment_s=value)


def test_measured_segment_overhead_is_small_and_positive():
    """A checkpoint region costs something (entering it, the RNG state, the recompute's
    start) but far less than a millisecond on this CPU; it is what keeps a segment
    whose recompute is empty from looking free."""
    rates = measure_rates()
    assert 0 < rates.segment_s < 1e-3
