"""The chain planner under a time limit: the best plan found, with a proven lower bound."""

from __future__ import annotations

import random

import pytest

from lightning_ckpt.planning.chain_planner import solve_chain
from lightning_ckpt.planning.costs import BlockCost, StepCost
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.planning.recompute_cost import recompute_cost


def jittered_encoder(n: int, seed: int, jitter: float = 0.05) -> StepCost:
    """Encoder-like blocks (benchmarks/chain_planner.py's ENCODER_BLOCK), every size and
    FLOP count jittered by up to +-`jitter`: near ties everywhere, the planner's hard case."""
    rng = random.Random(seed)

    def j(v: int) -> int:
        return int(v * (1 + rng.uniform(-jitter, jitter)))

    blocks = []
    for i in range(n):
        x = j(1048576)
        blocks.append(BlockCost(
            f"block{i}", saved_bytes=max(j(31490048), x), input_bytes=x, input_saved_bytes=x, output_bytes=j(1048576),
            fwd_transient_bytes=j(1048576), bwd_transient_bytes=j(4456960), grad_bytes=j(793088), fwd_flops=j(939524096),
        ))
    return StepCost(blocks=tuple(blocks), batch_size=16, static_bytes=3 * 793088 * n + 20_000_000,
                    outside_grad_bytes=330768, pre_saved_bytes=1048576, post_saved_bytes=3165208,
                    optimizer_transient_bytes=524288)


@pytest.mark.parametrize("frac", [0.25, 0.75])
def test_time_limited_plan_fits_and_its_bound_holds(frac):
    cost = jittered_encoder(160, seed=7)
    full = predict_peak(cost, [(i, i) for i in range(cost.n_blocks)]).peak_bytes
    none = predict_peak(cost, []).peak_bytes
    budget = int(full + frac * (none - full))
    exact = solve_chain(cost, budget, "flops")
    quick = solve_chain(cost, budget, "flops", time_limit_s=0.0)  # stops after its first position
    assert exact.lower_bound is None and exact.gap == 0.0
    assert quick.lower_bound is not None
    assert quick.lower_bound <= exact.cost <= quick.cost
    assert 0.0 <= quick.gap < 0.05
    assert predict_peak(cost, quick.segments).peak_bytes == quick.peak_bytes <= budget
    assert recompute_cost(cost, quick.segments) == quick.cost


def test_a_generous_limit_changes_nothing():
    cost = jittered_encoder(40, seed=3)
    budget = predict_peak(cost, [(i, i) for i in range(40)]).peak_bytes + 10 * 31490048
    assert solve_chain(cost, budget, "flops", time_limit_s=60.0) == solve_chain(cost, budget, "flops")
