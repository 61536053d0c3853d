"""Op-level options: the per-block frontier, and the joint planner against brute force."""

from __future__ import annotations

import itertools
import random

import pytest
from oracles import all_plans, chainable
from test_chain_planner import BEAMS, NS_RATES, rich_cost, with_work
from test_policies import random_cost

from lightning_ckpt.planning.chain_planner import solve_chain
from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.planning.op_options import (
    OpOption,
    block_options,
    describe_keeps,
    kept_bytes,
    option_items,
    step_options,
    undominated,
    validate_keeps,
)
from lightning_ckpt.planning.recompute_cost import recompute_cost, segment_cost


def random_ops(rng: random.Random, block: BlockCost, k: int) -> tuple[OpCost, ...]:
    """`k` calls of which most are items; their kept bytes sum to about the block's saved
    bytes (sometimes more: kept random draws are bytes beyond what backward saves)."""
    ops = []
    budget = max(block.saved_bytes, 1)
    for j in range(k):
        kind = rng.choice(("mm", "mm", "gelu", "bernoulli_", "view"))
        ops.append(
            OpCost(
                op=f"aten.{kind}.default",
                call_index=j,
                keep_bytes=rng.randint(0, budget // max(k - 1, 1) + 1),
                saved=rng.random() < 0.85,
                keepable=kind != "view",
                in_tail=rng.random() < 0.1,
                flops=rng.choice((0, rng.randint(0, max(block.fwd_flops // k, 1)))),
                mem_bytes=rng.randint(0, 10),
                rng_bytes=rng.randint(0, 10) if kind == "bernoulli_" else 0,
            )
        )
    return tuple(ops)


def with_ops(rng: random.Random, cost: StepCost, max_items: int) -> StepCost:
    blocks = tuple(
        BlockCost(**{**b.__dict__, "ops": random_ops(rng, b, rng.randint(0, max_items))}) for b in cost.blocks
    )
    return StepCost(**{**cost.__dict__, "blocks": blocks})


def whole_block_bytes(block: BlockCost) -> int:
    """Kept bytes from which holding the whole block (not checkpointing it) holds no more."""
    return block.saved_bytes + block.shared_with_previous_bytes - (block.input_bytes - block.input_saved_by_previous_bytes)


def brute_frontier(block: BlockCost, metric="flops", rates=None) -> list[tuple[int, float]]:
    """Every subset of the items: for each kept byte count reached, the best value; dominated
    dropped, and so is whatever holds as much as the whole block."""
    items = option_items(block)
    from lightning_ckpt.planning.op_options import op_value

    pts = {}
    for r in range(len(items) + 1):
        for sub in itertools.combinations(items, r):
            w = sum(o.keep_bytes for o in sub)
            v = sum(op_value(o, block, metric, rates) for o in sub)
            pts[w] = max(pts.get(w, -1.0), v)
    front, best = [], 0.0
    for w in sorted(pts):
        if pts[w] > best and w < whole_block_bytes(block):
            front.append((w, pts[w]))
            best = pts[w]
    return front


@pytest.mark.parametrize("seed", range(60))
def test_block_options_are_the_exact_frontier(seed):
    rng = random.Random(seed)
    cost = with_ops(rng, random_cost(rng, 1), 9)
    blk = cost.blocks[0]
    got = [(o.keep_bytes, o.value) for o in block_options(blk, "flops", None)]
    assert got == brute_frontier(blk)
    for o in block_options(blk, "flops", None):
        assert kept_bytes(blk, o.keys) == o.keep_bytes


def test_dominated_options_are_dropped():
    """(bytes kept, recompute left) of (4, 3), (14, 2), (17, 5) against the whole block held
    (8, 0): (17, 5) holds more than (14, 2) and recomputes more, and (14, 2) holds more than
    the whole block while still recomputing. Only (4, 3) is worth offering."""
    whole_recompute = 10.0
    pts = [OpOption(b, whole_recompute - left, (("aten.mm.default", k),)) for k, (b, left) in enumerate(((4, 3), (14, 2), (17, 5)))]
    assert [(o.keep_bytes, whole_recompute - o.value) for o in undominated(pts, whole_bytes=8)] == [(4, 3)]
    assert [(o.keep_bytes, whole_recompute - o.value) for o in undominated(pts)] == [(4, 3), (14, 2)]
    # equal points: one, the first by keys; worthless ones: none
    same = [OpOption(5, 1.0, (("aten.mm.default", 1),)), OpOption(5, 1.0, (("aten.mm.default", 0),))]
    assert undominated(same) == [same[1]]
    assert undominated([OpOption(3, 0.0, ()), OpOption(4, -1.0, ())]) == []


@pytest.mark.parametrize("seed", range(40))
def test_block_options_are_never_dominated_in_time(seed):
    """With measured savings (scaling options down, the draws apart) and fixed costs per call,
    whatever the numbers: bytes and values strictly rising, every value > 0, each lighter than
    the whole block."""
    from test_keep_calibration import RATES

    rng = random.Random(7_000 + seed)
    blk = with_ops(rng, random_cost(rng, 1), 8).blocks[0]
    blk = BlockCost(**{**blk.__dict__, "keep_saved_ms": rng.choice((None, -1.0, 1e-4, 1.0)),
                       "keep_draws_saved_ms": rng.choice((None, -1.0, 1e-4, 1.0))})
    opts = block_options(blk, "time", RATES)
    assert all(o.value > 0 and o.keep_bytes < whole_block_bytes(blk) for o in opts)
    assert all(a.keep_bytes < b.keep_bytes and a.value < b.value for a, b in zip(opts, opts[1:]))


@pytest.mark.parametrize("seed", range(60))
def test_dropping_options_heavier_than_the_whole_block_never_changes_the_optimum(seed):
    """Brute force over every plan and option, with and without the whole-block dominance, on
    costs whose kept calls are parts of their block's recompute (as profiled ones are)."""
    import lightning_ckpt.planning.op_options as op_options

    rng = random.Random(11_000 + seed)
    n = rng.randint(1, 4)
    cost = with_ops(rng, random_cost(rng, n) if seed % 2 else rich_cost(rng, n, huge=False), 4)
    pruned = outcomes(cost, "flops")
    keep_all = op_options.undominated
    try:
        op_options.undominated = lambda points, whole_bytes=None: keep_all(points)
        every = outcomes(cost, "flops")
        offered = step_options(cost, "flops", None)
    finally:
        op_options.undominated = keep_all
    if any(o.value > segment_cost(cost, p, p, "flops") for p, opts in enumerate(offered) for o in opts):
        pytest.skip("a random call avoids more than its block's recompute: not a profile's costs")
    for budget in sorted({p for _, p, _, _ in every}):
        best = min(c for c, p, _, _ in every if p <= budget)
        assert min((c for c, p, _, _ in pruned if p <= budget), default=None) == best, budget


def test_max_options_keeps_the_heaviest_and_spreads():
    ops = tuple(OpCost("aten.mm.default", j, keep_bytes=2**j, saved=True, keepable=True, flops=2**j) for j in range(6))
    blk = BlockCost("b", saved_bytes=100, input_bytes=1, fwd_flops=100, ops=ops)
    full = block_options(blk, "flops", None)
    assert len(full) == 63  # every subset of powers of two is its own frontier point
    few = block_options(blk, "flops", None, max_options=4)
    assert len(few) == 4 and few[-1] == full[-1] and few[0] == full[0]


def outcomes(cost: StepCost, metric: str) -> list[tuple[float, int, list, dict]]:
    """(recompute, peak, segments, keeps) of every plan and every choice of frontier option."""
    opts = step_options(cost, metric, cost.rates)
    out = []
    for segs in all_plans(cost.n_blocks):
        if not chainable(cost, segs):
            continue
        singles = [a for a, b in segs if a == b and opts[a]]
        for pick in itertools.product(*[range(len(opts[p]) + 1) for p in singles]):
            keeps = {p: opts[p][j - 1].keys for p, j in zip(singles, pick) if j}
            out.append((recompute_cost(cost, segs, metric, keeps), predict_peak(cost, segs, keeps).peak_bytes, segs, keeps))
    return out


def check_against(cost: StepCost, budget: int, plans: list, metric: str, beam) -> None:
    fits = [(c, p) for c, p, _, _ in plans if p <= budget]
    sol = solve_chain(cost, budget, metric, beam=beam, granularity="op")
    if not fits:
        assert sol is None, (budget, sol)
        return
    assert sol is not None, budget
    expected = min(fits)
    keeps = validate_keeps(cost, sol.segments, sol.keeps)
    got = (recompute_cost(cost, sol.segments, metric, keeps), predict_peak(cost, sol.segments, keeps).peak_bytes)
    if metric == "flops":
        assert got == expected, (budget, got, expected, sol)
    else:  # estimated times: the planner sums whole nanoseconds, the oracle float ms
        assert got[0] == pytest.approx(expected[0], abs=1e-5) and got[1] <= budget
    assert sol.peak_bytes == got[1]


@pytest.mark.parametrize("seed", range(150))
def test_joint_planner_equals_brute_force(seed):
    """Up to 5 blocks x up to 6 frontier options each, every solver mode, several budgets."""
    rng = random.Random(50_000 + seed)
    n = rng.randint(1, 5 if seed % 3 else 4)
    base = random_cost(rng, n) if seed % 2 else rich_cost(rng, n, huge=False)
    cost = with_ops(rng, base, 3 if n == 5 else 4)
    opts = step_options(cost, "flops", None)
    assert all(len(o) <= 15 for o in opts)
    plans = outcomes(cost, "flops")
    peaks = sorted({p for _, p, _, _ in plans})
    budgets = [rng.choice(peaks) for _ in range(3)] + [rng.randint(peaks[0] - 5, peaks[-1] + 5)]
    for budget in budgets:
        for beam in BEAMS:
            check_against(cost, budget, plans, "flops", beam)


@pytest.mark.parametrize("seed", range(40))
def test_joint_planner_equals_brute_force_on_six_blocks(seed):
    rng = random.Random(90_000 + seed)
    cost = with_ops(rng, random_cost(rng, 6), 3)
    plans = outcomes(cost, "flops")
    peaks = sorted({p for _, p, _, _ in plans})
    for budget in (rng.choice(peaks), rng.choice(peaks)):
        check_against(cost, budget, plans, "flops", 0)


@pytest.mark.parametrize("seed", range(30))
def test_joint_planner_time_metric_equals_brute_force(seed):
    rng = random.Random(70_000 + seed)
    n = rng.randint(1, 4)
    cost = with_ops(rng, with_work(rng, random_cost(rng, n), NS_RATES), 4)
    plans = outcomes(cost, "time")
    peaks = sorted({p for _, p, _, _ in plans})
    for budget in (rng.choice(peaks), rng.choice(peaks)):
        check_against(cost, budget, plans, "time", 0)


def test_op_plans_never_cost_more_than_block_plans():
    rng = random.Random(3)
    for _ in range(40):
        cost = with_ops(rng, random_cost(rng, rng.randint(2, 12)), 6)
        lo = predict_peak(cost, [(i, i) for i in range(cost.n_blocks)]).peak_bytes
        hi = predict_peak(cost, []).peak_bytes
        for budget in (lo, (lo + hi) // 2, hi):
            blk = solve_chain(cost, budget, "flops")
            op = solve_chain(cost, budget, "flops", granularity="op")
            assert (blk is None) == (op is None) or blk is None
            if blk is not None:
                assert op.cost <= blk.cost


@pytest.mark.parametrize("seed", range(20))
def test_in_time_op_plans_never_cost_more_and_without_a_measured_saving_are_block_plans(seed):
    """In `time`, with fixed costs per call and savings measured on some blocks: the op-level
    optimum never costs more than the block-level one; when no block saved anything beyond the
    measurement's noise (0 or less), it is the block-level plan itself."""
    import dataclasses

    rng = random.Random(30_000 + seed)
    rates = dataclasses.replace(NS_RATES, op_call_s=2e-9, segment_s=5e-9, keep_draws_op_s=1e-10, keep_ops_op_s=3e-10)
    base = with_ops(rng, with_work(rng, random_cost(rng, rng.randint(2, 10)), rates), 5)
    measured = [rng.choice((None, 0.0, -1e-6, 1e-5, 1e-3)) for _ in base.blocks]
    cost = StepCost(**{**base.__dict__, "blocks": tuple(
        BlockCost(**{**b.__dict__, "keep_saved_ms": m, "keep_draws_saved_ms": m}) for b, m in zip(base.blocks, measured)
    )})
    nothing = StepCost(**{**base.__dict__, "blocks": tuple(
        BlockCost(**{**b.__dict__, "keep_saved_ms": 0.0, "keep_draws_saved_ms": 0.0}) for b in base.blocks
    )})
    lo = predict_peak(cost, [(i, i) for i in range(cost.n_blocks)]).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    for budget in (lo, (lo + hi) // 2, hi):
        blk = solve_chain(cost, budget, "time")
        op = solve_chain(cost, budget, "time", granularity="op")
        if blk is not None:
            assert op is not None and op.cost <= blk.cost + 1e-9
        assert step_options(nothing, "time", rates) == [()] * cost.n_blocks
        plain = solve_chain(nothing, budget, "time")
        same = solve_chain(nothing, budget, "time", granularity="op")
        assert (plain is None) == (same is None)
        if plain is not None:
            assert (same.segments, same.keeps, same.cost, same.peak_bytes) == (plain.segments, {}, plain.cost, plain.peak_bytes)


def test_identical_blocks_48_with_real_sized_options_plan_fast():
    """48 identical blocks, each with a 16-call frontier: the whole op-level plan with bounded
    work, counted in solver states (deterministic; about 150 000 to 290 000 states, 1-2 s on
    the idle 2-core CPU here), not in seconds."""
    rng = random.Random(11)
    ops = tuple(
        OpCost(f"aten.{k}.default", j, keep_bytes=rng.randint(1, 40) * 2**16, saved=True, keepable=True,
               flops=rng.randint(0, 5) * 10**6, mem_bytes=rng.randint(1, 9) * 2**16)
        for j, k in enumerate(("addmm", "gelu", "bernoulli_", "native_layer_norm") * 4)
    )
    blk = BlockCost("enc", saved_bytes=sum(o.keep_bytes for o in ops), input_bytes=2**20, output_bytes=2**20,
                    fwd_flops=sum(o.flops for o in ops), fwd_mem_bytes=sum(o.mem_bytes for o in ops), ops=ops)
    cost = StepCost(blocks=tuple(BlockCost(**{**blk.__dict__, "name": f"b{i}"}) for i in range(48)), batch_size=16,
                    static_bytes=2**24, meta={"rates": NS_RATES.to_dict()})
    lo = predict_peak(cost, [(i, i) for i in range(48)]).peak_bytes
    hi = predict_peak(cost, []).peak_bytes
    n_opts = len(step_options(cost, "time", cost.rates)[0])
    assert n_opts >= 10
    for frac in (0.25, 0.5, 0.75):
        stats: dict = {}
        sol = solve_chain(cost, int(lo + frac * (hi - lo)), "time", granularity="op", stats=stats)
        assert sol is not None and sol.keeps
        assert stats["frontier"] + stats["pool"] < 700_000 and stats["max_frontier"] < 16_000, (frac, stats)


def test_validate_keeps_errors_say_what_is_wrong():
    ops = (OpCost("aten.mm.default", 0, 8, True, True, flops=5), OpCost("aten.view.default", 0, 0, True, False))
    blk = BlockCost("b", saved_bytes=10, input_bytes=1, fwd_flops=5, ops=ops)
    cost = StepCost(blocks=(blk, BlockCost(**{**blk.__dict__, "name": "c"})), batch_size=1)
    assert validate_keeps(cost, [(0, 0)], {0: [("aten.mm.default", 0)], 1: []}) == {0: (("aten.mm.default", 0),)}
    with pytest.raises(ValueError, match="not a checkpointed segment of its own"):
        validate_keeps(cost, [(0, 1)], {0: [("aten.mm.default", 0)]})
    with pytest.raises(ValueError, match=r"cannot keep \[\('aten.view.default', 0\)\]"):
        validate_keeps(cost, [(0, 0)], {0: [("aten.view.default", 0)]})
    with pytest.raises(ValueError, match="the chain has 2 blocks"):
        validate_keeps(cost, [(0, 0)], {5: [("aten.mm.default", 0)]})
    assert describe_keeps(blk, [("aten.mm.default", 0)]) == "keeps: mm; recomputes: nothing"


def test_op_plan_table_and_round_trip():
    ops = (
        OpCost("aten.addmm.default", 0, 40, True, True, flops=900),
        OpCost("aten.gelu.default", 0, 40, True, True, mem_bytes=40),
        OpCost("aten.bernoulli_.float", 0, 10, True, True, rng_bytes=40),
        OpCost("aten.addmm.default", 1, 40, True, True, flops=900),
    )
    blk = BlockCost("enc", saved_bytes=130, input_bytes=10, output_bytes=10, fwd_flops=1800, fwd_mem_bytes=40,
                    fwd_rng_bytes=40, ops=ops)
    cost = StepCost(blocks=tuple(BlockCost(**{**blk.__dict__, "name": f"b{i}"}) for i in range(4)), batch_size=2)
    none = predict_peak(cost, []).peak_bytes
    from lightning_ckpt.planning.plan import Plan
    from lightning_ckpt.planning.policies import make_plan

    block = make_plan(cost, "optimal", none - 100, metric="flops")
    plan = make_plan(cost, "optimal", none - 100, metric="flops", granularity="op")
    assert plan.keeps and plan.recompute_flops < block.recompute_flops
    text = str(plan)
    assert "selective" in text and "keeps: addmm x2; recomputes: gelu, bernoulli_" in text
    assert "of them keep op outputs" in text
    back = Plan.from_dict(plan.to_dict())
    assert back == plan and back.keep_ops == plan.keep_ops
    assert plan.predicted_peak_bytes == predict_peak(cost, plan.segments, plan.keep_ops).peak_bytes <= none - 100
    with pytest.raises(ValueError, match="has no per-op costs"):
        make_plan(StepCost(blocks=(BlockCost("x", 10, 1, fwd_flops=3),), batch_size=1), "optimal", 10**6,
                  granularity="op")


def test_keeping_costs_its_fixed_overhead_and_draws_their_copies():
    """In `time`, an option pays per op call of its block for the dispatch modes (more when it
    keeps other calls than draws), and a kept draw pays for storing and writing back its mask;
    a block whose calls are too cheap to be worth that has no options."""
    from lightning_ckpt.costs.machine_rates import MachineRates
    from lightning_ckpt.planning.op_options import kept_value, op_value

    draw = OpCost("aten.bernoulli_.float", 0, keep_bytes=1000, saved=True, keepable=True, rng_bytes=4000)
    mm = OpCost("aten.mm.default", 0, keep_bytes=4000, saved=True, keepable=True, flops=10**6)
    views = tuple(OpCost("aten.view.default", j, 0, False, False) for j in range(8))
    blk = BlockCost("b", saved_bytes=8000, input_bytes=100, fwd_flops=10**6, fwd_rng_bytes=4000, ops=(draw, mm, *views))
    rates = MachineRates(flop_per_s=1e9, mem_byte_per_s=1e9, rng_byte_per_s=1e8, keep_draws_op_s=1e-6, keep_ops_op_s=1e-5)
    assert op_value(draw, blk, "time", rates) == pytest.approx(1e3 * (4000 / 1e8 - 5000 / 1e9))
    assert kept_value(blk, [draw.key], "time", rates) == pytest.approx(op_value(draw, blk, "time", rates) - 1e3 * 10 * 1e-6)
    both = kept_value(blk, [draw.key, mm.key], "time", rates)
    assert both == pytest.approx(op_value(draw, blk, "time", rates) + 1.0 - 1e3 * 10 * 1e-5)
    opts = block_options(blk, "time", rates)
    assert [o.keys for o in opts] == [(draw.key,), (mm.key,), tuple(sorted((draw.key, mm.key)))]
    assert [o.value for o in opts] == pytest.approx([kept_value(blk, o.keys, "time", rates) for o in opts])
    costly = MachineRates(flop_per_s=1e9, mem_byte_per_s=1e9, rng_byte_per_s=1e8, keep_draws_op_s=1e-3, keep_ops_op_s=1e-3)
    assert block_options(blk, "time", costly) == ()
