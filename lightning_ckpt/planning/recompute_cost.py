"""What recomputing blocks costs, in one of three metrics (apart from memory).

flops: FLOPs counted by torch (deterministic; ops without FLOPs, like layer norm,
count 0). ms: each block's forward timed once when profiling (noisy). time:
estimated milliseconds, the block's FLOPs, memory-bound bytes and random bytes each
at the machine rate measured with the profile (`MachineRates`) and a fixed cost per
op call it recomputes (`MachineRates.op_call_s`), plus, under sharded training, the
parameter bytes its recompute all-gathers again and the collectives its forward runs (tensor
parallelism) at the measured all-gather rate. Every checkpointed block is rebuilt once; a
segment's last block skips its ops and collectives after its last saved tensor (torch's early
stop), never its gather (it comes first); a segment adds a fixed, measured overhead in `time`.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.nested_model import direct_children, nested_segment_cost
from lightning_ckpt.planning.op_options import Keeps, kept_value

Segments = Sequence[tuple[int, int]]

COST_METRICS = ("flops", "ms", "time")


def metric_rates(cost: StepCost, metric: str) -> MachineRates | None:
    """The machine rates `metric` needs from `cost`: those of the profile for `time`, else None."""
    if metric not in COST_METRICS:
        raise ValueError(f"metric={metric!r} is not a known recompute cost; choose one of {', '.join(COST_METRICS)}.")
    if metric != "time":
        return None
    rates = cost.rates
    if rates is None:
        raise ValueError(
            "metric='time' turns counted FLOPs and bytes into time at the machine rates measured with the "
            "profile, but this StepCost has none (meta['rates'] is missing). Profile with "
            "profile_model(..., timing=True) (the default) or rates=MachineRates(...), or use metric='flops'."
        )
    return rates


def block_recompute(block, metric: str = "flops", rates: MachineRates | None = None) -> float:
    """Forward cost of one block in `metric` (`flops`, `ms`, or `time` with `rates`); in `time`
    with the all-gather of its `gather_bytes` and its collectives (`fwd_comm_bytes`), 0 ms
    without a measured all-gather rate."""
    if metric == "flops":
        return block.fwd_flops
    if metric == "ms":
        return block.fwd_ms
    rates = _need_rates(rates, metric)
    work = rates.fwd_ms(block.fwd_flops, block.fwd_mem_bytes, block.fwd_rng_bytes, op_calls(block))
    return work + rates.gather_ms(block.gather_bytes + block.fwd_comm_bytes)


def op_calls(block, tail: bool = False) -> int:
    """How many op calls `block`'s forward makes (`BlockCost.ops`; 0 when not profiled per op),
    or with `tail` how many of them run after its last saved tensor."""
    return sum(1 for op in block.ops if op.in_tail) if tail else len(block.ops)


def skipped_tail(block, metric: str = "flops", rates: MachineRates | None = None) -> float:
    """What torch's early stop skips when `block` ends a segment: the ops after its
    last saved tensor (`tail_flops`; measured times scaled by the same fraction;
    estimated times from the tail's own FLOPs, bytes and op calls)."""
    if metric == "flops":
        return block.tail_flops
    if metric == "ms":
        return block.fwd_ms * (block.tail_flops / block.fwd_flops) if block.fwd_flops else 0.0
    rates = _need_rates(rates, metric)
    tail = rates.fwd_ms(block.tail_flops, block.tail_mem_bytes, block.tail_rng_bytes, op_calls(block, tail=True))
    return tail + rates.gather_ms(block.tail_comm_bytes)


def _need_rates(rates: MachineRates | None, metric: str) -> MachineRates:
    if metric != "time":
        raise ValueError(f"metric={metric!r} is not a known recompute cost; choose one of {', '.join(COST_METRICS)}.")
    if rates is None:
        raise ValueError("metric='time' needs the machine rates: pass rates=cost.rates (see metric_rates).")
    return rates


def segment_cost(
    cost: StepCost, first: int, last: int, metric: str = "flops", rates: MachineRates | None = None
) -> float:
    """What rebuilding one segment costs: the forward of its blocks, each once, less
    the skipped tail of its last block. `rates` default to the profile's (`time`)."""
    if rates is None:
        rates = metric_rates(cost, metric)
    blocks = cost.blocks
    return (
        sum(block_recompute(blocks[i], metric, rates) for i in range(first, last + 1))
        - skipped_tail(blocks[last], metric, rates)
        + segment_overhead(metric, rates)
    )


def segment_overhead(metric: str, rates: MachineRates | None) -> float:
    """The fixed cost of one checkpointed segment in `metric`: measured for `time`
    (`MachineRates.segment_s`), none in counted FLOPs or per-block timings."""
    return 1e3 * rates.segment_s if metric == "time" and rates is not None else 0  # an int: FLOPs stay exact


def recompute_cost(
    cost: StepCost, segments: Segments, metric: str = "flops", keeps: Keeps | None = None, inner: Segments = ()
) -> float:
    """Recompute cost of a plan: every checkpointed block is rebuilt exactly once, less
    what the op outputs `keeps` keeps (blocks checkpointed alone, `op_options`) avoid;
    a segment with `inner` segments inside costs `nested_model.nested_segment_cost`."""
    return plan_recompute(cost, segments, metric, metric_rates(cost, metric), keeps, inner)


def plan_recompute(
    cost: StepCost, segments: Segments, metric: str, rates: MachineRates | None, keeps: Keeps | None = None,
    inner: Segments = (),
) -> float:
    """`recompute_cost` with the machine rates already read (`metric_rates(cost, metric)`)."""
    total = 0
    for a, b in segments:
        if inner and direct_children(a, b, inner):
            total += nested_segment_cost(
                cost, a, b, inner,
                lambda i: block_recompute(cost.blocks[i], metric, rates),
                lambda i: skipped_tail(cost.blocks[i], metric, rates),
                segment_overhead(metric, rates),
            )
        else:
            total += segment_cost(cost, a, b, metric, rates)
    for p, keys in (keeps or {}).items():
        total -= kept_value(cost.blocks[p], keys, metric, rates)
    return total
