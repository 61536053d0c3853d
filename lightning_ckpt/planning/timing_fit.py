"""What timing the profiled blocks says about the `time` metric, as plain data and fits.

`keep_calibration` times one block of each kind alone on the whole batch (`BlockTiming`);
here those timings become costs: the savings of keeping that lie beyond the measurement's
noise (`trusted_saving`, `with_block_timings`; `saving_undecided` tells the timing when more
rounds may still change that), the fixed cost of each recomputed op call that makes the
estimated recompute match the measured one (`fit_op_call_s`), and the fixed cost per op
call of the selective modes that makes the options' values match what keeping all of a
block's calls and only some of them saved (`fit_keep_ops_op_s`). No torch: numbers only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.op_options import OpKey, op_value, option_items
from lightning_ckpt.planning.recompute_cost import block_recompute, op_calls, skipped_tail

__all__ = [
    "BlockTiming",
    "MIN_SHARE",
    "fit_keep_ops_op_s",
    "fit_op_call_s",
    "saving_undecided",
    "trusted_saving",
    "with_block_timings",
]

# A saving of keeping below this share of its block's measured recompute counts as none: an
# op-level option makes its block a segment of its own, and what moving segment boundaries
# does to a step is not modelled that finely. On HF BERT-48 here, op-level plans that differed
# from the block-level ones in 3 to 10 blocks, for a predicted 0.4 % of a step (keeping the
# draws saved 0.39 ms beyond noise of a 10.4 ms recompute), measured -4.5 % to +2.9 %.
MIN_SHARE = 0.05


@dataclass(frozen=True)
class BlockTiming:
    """What one forward + backward of a block run alone on the whole batch was measured to save
    and cost, in ms (medians over rounds of each round's difference).

    all_ms: keeping every keepable call (`op_options.option_items`) over keeping nothing; None
        when it has nothing to keep. draws_ms: keeping only its random calls; None when it has
        none to keep. Either may be negative: keeping then cost more time than it saved.
    noise_ms: how far those medians may be off by the rounds' own spread (a few standard
        errors of the larger one); `with_block_timings` keeps only what lies beyond it.
    recompute_ms: checkpointed alone keeping nothing over not checkpointed: what recomputing
        it (without its tail) and its checkpoint region cost. rounds: rounds timed.
    part_keys, part_ms: a lighter choice of calls that are not random (an option of the
        block's frontier) and what keeping only those saved; () and None when not measured.
    """

    all_ms: float | None
    draws_ms: float | None
    noise_ms: float = 0.0
    recompute_ms: float | None = None
    rounds: int = 0
    part_keys: tuple[OpKey, ...] = ()
    part_ms: float | None = None


def _bar(recompute_ms: float | None) -> float:
    """The least saving that counts: `MIN_SHARE` of the block's measured recompute (0 unmeasured)."""
    return max(0.0, MIN_SHARE * recompute_ms) if recompute_ms is not None else 0.0


def trusted_saving(saved_ms: float, noise_ms: float, recompute_ms: float | None) -> float:
    """What a measured saving (a median over rounds, `noise_ms` its error) counts for.

    [rule] Its lower end `saved_ms - noise_ms` when that is positive and at least `MIN_SHARE`
    of the block's measured recompute; a loss (`saved_ms` < 0) as measured; else 0.0: a
    saving within its noise or too small to tell from moving a segment boundary counts as none."""
    beyond = saved_ms - noise_ms
    return beyond if beyond > 0 and beyond >= _bar(recompute_ms) else min(saved_ms, 0.0)


def saving_undecided(saved_ms: float, noise_ms: float, recompute_ms: float | None) -> bool:
    """Whether more rounds may still change what `trusted_saving` makes of a saving: its noise
    band `saved_ms +- noise_ms` holds the bar it has to clear (`MIN_SHARE` of the recompute,
    at least 0). A band wholly above the bar is trusted, one wholly below it is not; one across
    it narrows with more rounds. The timing goes on while this holds: stopping
    when the saving clears its noise alone left savings well above the bar counted as none
    (7.0 ms +- 6.4 ms of a 28 ms recompute, the 48-block encoder on a loaded machine)."""
    return saved_ms - noise_ms <= _bar(recompute_ms) <= saved_ms + noise_ms


def with_block_timings(cost: StepCost, timings: Mapping[int, BlockTiming], measured_batch: int) -> StepCost:
    """`cost` with what keeping was measured to save beyond its noise (`trusted_saving`: the
    median less `BlockTiming.noise_ms`; a saving within the noise, or below `MIN_SHARE` of the
    block's measured recompute, counts as none) in its blocks' `keep_saved_ms` and
    `keep_draws_saved_ms`, scaled from batch `measured_batch` to `cost.batch_size` in
    proportion to the batch."""
    if measured_batch < 1:
        raise ValueError(f"measured_batch={measured_batch} must be a positive batch size.")
    scale = cost.batch_size / measured_batch

    def robust(v: float | None, t: BlockTiming) -> float | None:
        return None if v is None else trusted_saving(v, t.noise_ms, t.recompute_ms) * scale

    blocks = tuple(
        b if i not in timings or timings[i].all_ms is None else dataclasses.replace(
            b, keep_saved_ms=robust(timings[i].all_ms, timings[i]), keep_draws_saved_ms=robust(timings[i].draws_ms, timings[i])
        )
        for i, b in enumerate(cost.blocks)
    )
    return dataclasses.replace(cost, blocks=blocks)


def fit_op_call_s(cost: StepCost, timings: Mapping[int, BlockTiming], rates: MachineRates) -> float | None:
    """The fixed seconds per recomputed op call (`MachineRates.op_call_s`) that make the `time`
    estimate of recomputing each measured block alone match `BlockTiming.recompute_ms`.

    [fit] A block checkpointed alone recomputes its calls before its last saved tensor and pays
    one segment: measured_b = work_b + segment + calls_b * c, the work at `rates` (nothing per
    call). Least squares over the blocks of `cost` (each measured kind once per block of its
    kind): c = sum(calls_b * residual_b) / sum(calls_b ** 2), at least 0. None when no block
    was measured or none makes a call."""
    bare = dataclasses.replace(rates, op_call_s=0.0)
    num = den = 0.0
    for i, t in timings.items():
        if t.recompute_ms is None:
            continue
        blk: BlockCost = cost.blocks[i]
        calls = op_calls(blk) - op_calls(blk, tail=True)
        work = block_recompute(blk, "time", bare) - skipped_tail(blk, "time", bare) + 1e3 * rates.segment_s
        num += calls * (t.recompute_ms - work)
        den += calls * calls
    if den == 0:
        return None
    return max(0.0, num / den) * 1e-3


def fit_keep_ops_op_s(cost: StepCost, timings: Mapping[int, BlockTiming], rates: MachineRates) -> float | None:
    """The seconds per op call of a block that keeping calls other than draws costs
    (`MachineRates.keep_ops_op_s`, the selective modes), fitted so that an option's value
    (`op_options`: the measured saving of keeping every call, S_all, spread over the options
    in proportion to their estimates net of this cost) also matches the measured saving of
    keeping the lighter choice `BlockTiming.part_keys`, S_part.

    [fit] With estimates V_all and V_part (`op_options.op_value`, `time`) and a fixed cost O
    the same for both: S_all (V_part - O) = S_part (V_all - O), so
    O = (S_all V_part - S_part V_all) / (S_all - S_part), per op call O / calls_b. Least squares
    over the blocks of `cost` whose two savings are apart (S_all > S_part): c = sum(calls_b O_b)
    / sum(calls_b ** 2), at least 0. None when no block had both measured so."""
    num = den = 0.0
    for i, t in timings.items():
        if t.part_ms is None or t.all_ms is None or not t.all_ms > t.part_ms:
            continue
        blk: BlockCost = cost.blocks[i]
        part = set(t.part_keys)
        v_all = sum(op_value(op, blk, "time", rates) for op in option_items(blk))
        v_part = sum(op_value(op, blk, "time", rates) for op in option_items(blk) if op.key in part)
        fixed = (t.all_ms * v_part - t.part_ms * v_all) / (t.all_ms - t.part_ms)
        calls = len(blk.ops)
        num += calls * fixed
        den += calls * calls
    if den == 0:
        return None
    return max(0.0, num / den) * 1e-3
