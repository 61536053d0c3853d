"""Op-level (selective) options of a checkpointed block: which op outputs to keep.

A block checkpointed on its own may keep some of its op calls' outputs from the forward
to its backward instead of recomputing them (torch's selective checkpoint contexts).
Keeping a call costs its `OpCost.keep_bytes` for the whole time between the block's
forward and its backward, and saves its recompute (`op_value`). Which calls to keep is a
0/1 knapsack per block (items: the calls, weight: bytes kept, value: recompute
avoided); `block_options` enumerates its whole Pareto frontier with the exact solver.
In the `time` metric the values are estimates from counted work, scaled down to what
keeping was measured to save in the block beyond the measurement's noise when the profile
measured it (`keep_calibration`): a block whose saving is within that noise has no options.

[constraint] Only calls whose outputs backward saves (or whose random draws the
recompute would repeat) and that run before the block's last saved tensor are items:
their outputs exist again anyway when the block's backward runs, so keeping them does
not change the block's backward peak, only what it holds in between. Calls after the
last saved tensor are never recomputed (torch's early stop) and are worth nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.solvers.knapsack import exact_knapsack

OpKey = tuple[str, int]
Keeps = Mapping[int, Collection[OpKey]]

GRANULARITIES = ("block", "op")


@dataclass(frozen=True)
class OpOption:
    """One selective choice for a block: keep the calls `keys`, recompute the rest.

    keep_bytes: bytes the kept outputs hold from the block's forward to its backward.
    value: recompute the kept calls avoid, in the metric's units (`op_value`).
    """

    keep_bytes: int
    value: float
    keys: tuple[OpKey, ...]


def op_value(op: OpCost, block: BlockCost, metric: str, rates: MachineRates | None) -> float:
    """The recompute a kept call avoids, in `metric` (as `recompute_cost.block_recompute`).

    flops: its FLOPs. time: its FLOPs, memory-bound and random bytes at the machine rates;
    for a random call (it writes random bytes) less the copies that keep its draws (one
    byte per element written in the forward, the draws written back in the recompute).
    ms: the block's measured time split over its calls in proportion to their estimated
    time (with the rates) or, without rates, to their FLOPs.
    """
    if metric == "flops":
        return op.flops
    if metric == "time":
        if rates is None:
            raise ValueError("metric='time' needs the machine rates: pass rates=cost.rates.")
        value = rates.fwd_ms(op.flops, op.mem_bytes, op.rng_bytes)
        if op.rng_bytes:
            value -= rates.fwd_ms(0, op.keep_bytes + op.rng_bytes, 0)
        return value
    if metric == "ms":
        if rates is not None:
            total = rates.fwd_ms(block.fwd_flops, block.fwd_mem_bytes, block.fwd_rng_bytes)
            part = rates.fwd_ms(op.flops, op.mem_bytes, op.rng_bytes)
        else:
            total, part = block.fwd_flops, op.flops
        return block.fwd_ms * part / total if total else 0.0
    raise ValueError(f"metric={metric!r} is not a known recompute cost; choose one of flops, ms, time.")


def option_items(block: BlockCost) -> list[OpCost]:
    """The calls of `block` an option may keep (see the module docstring)."""
    return [op for op in block.ops if op.keepable and op.saved and not op.in_tail and op.keep_bytes > 0]


def block_options(
    block: BlockCost, metric: str, rates: MachineRates | None, max_options: int | None = None
) -> tuple[OpOption, ...]:
    """The Pareto frontier of (bytes kept, recompute avoided) over the block's items.

    [recurrence] The best selection within the whole weight is the top of the frontier;
    the next point is the best selection strictly lighter than it, and so on down to
    nothing kept (`exact_knapsack` at each capacity; weights are whole bytes, so the
    solver is exact and "strictly lighter" is "at most one byte less"). Returned by
    ascending `keep_bytes`, values strictly rising, the empty option excluded (that is
    plain checkpointing), and without the options that holding the whole block beats
    (`undominated`). `max_options` keeps that many, spread evenly over the frontier,
    always with the heaviest.
    """
    items = [op for op in option_items(block) if op_value(op, block, metric, rates) > 0]
    points = _frontier(items, block, metric, rates)
    if metric == "time" and rates is not None:
        # [constraint] keeping random draws only costs `keep_draws_op_s` per op call of the block,
        # keeping other calls `keep_ops_op_s` (`keep_overhead_ms`): the best choice among the draws
        # alone is a frontier of its own, and a choice is worth it only when its net value is > 0
        points += _frontier([op for op in items if op.rng_bytes], block, metric, rates)
        points = [OpOption(o.keep_bytes, _net_ms(block, o.keys, o.value, rates), o.keys) for o in points]
    boundary = block.input_bytes - block.input_saved_by_previous_bytes  # held by a one-block segment in any case
    out = undominated(points, whole_bytes=block.saved_bytes + block.shared_with_previous_bytes - boundary)
    if max_options is not None and len(out) > max_options > 0:
        step = (len(out) - 1) / max(max_options - 1, 1)
        picks = sorted({round(k * step) for k in range(max_options)} | {len(out) - 1})
        out = [out[k] for k in picks]
    return tuple(out)


def undominated(points: Sequence[OpOption], whole_bytes: int | None = None) -> list[OpOption]:
    """The options no other beats or equals, by ascending `keep_bytes`, values strictly rising.

    [dominance] An option is dropped when another holds no more bytes and avoids at least as
    much recompute, when it avoids nothing (value <= 0: plain checkpointing does as well), and
    when it holds `whole_bytes` or more: not checkpointing the block at all then holds no more
    between its forward and its backward (its saved bytes, beyond the input a one-block segment
    keeps anyway) and recomputes nothing. Ties (equal bytes and value) keep the first by keys.
    """
    out: list[OpOption] = []
    for o in sorted(points, key=lambda o: (o.keep_bytes, -o.value, o.keys)):
        if o.value <= 0 or (whole_bytes is not None and o.keep_bytes >= whole_bytes):
            continue
        if out and (o.value <= out[-1].value or o.keep_bytes <= out[-1].keep_bytes):
            continue
        out.append(o)
    return out


def _frontier(items: list[OpCost], block: BlockCost, metric: str, rates: MachineRates | None) -> list[OpOption]:
    """The Pareto points of (bytes kept, value) over subsets of `items`, heaviest first."""
    if not items:
        return []
    weights = [float(op.keep_bytes) for op in items]
    values = [float(op_value(op, block, metric, rates)) for op in items]
    out: list[OpOption] = []
    cap = sum(op.keep_bytes for op in items)
    while cap > 0:
        _, chosen, _ = exact_knapsack(weights, values, float(cap))
        if not chosen:
            break
        kept = sum(items[i].keep_bytes for i in chosen)
        value = sum(values[i] for i in chosen)
        if not out or value < out[-1].value:  # always on an exact frontier; never keep a dominated point
            out.append(OpOption(kept, value, tuple(sorted(items[i].key for i in chosen))))
        cap = kept - 1
    return out


def _random_only(block: BlockCost, keys: Collection[OpKey]) -> bool:
    want = set(keys)
    return all(op.rng_bytes > 0 for op in block.ops if op.key in want)


def keep_overhead_ms(block: BlockCost, keys: Collection[OpKey], rates: MachineRates | None) -> float:
    """The fixed time an op-level block adds, in ms: per op call of the block, the dispatch
    modes that keep random draws (`MachineRates.keep_draws_op_s`) or, when it keeps any other
    call, torch's selective checkpoint modes as well (`keep_ops_op_s`). 0 when nothing is kept."""
    if not keys or rates is None:
        return 0.0
    per_op = rates.keep_draws_op_s if _random_only(block, keys) else rates.keep_ops_op_s
    return 1e3 * per_op * len(block.ops)


def keep_calibration(block: BlockCost, keys: Collection[OpKey], rates: MachineRates) -> float:
    """The factor in [0, 1] that scales the `time` value of keeping `keys` in `block` to what
    keeping was measured to save (`BlockCost.keep_saved_ms`, `lightning_ckpt.apply.keep_calibration`).

    [constraint] The estimate of keeping every call an option may keep (`option_items`, net of
    `keep_overhead_ms`) is V, the measured saving S (what lies beyond the measurement's noise:
    `keep_calibration.with_block_timings`); every option of the block is worth S / V of its
    estimate, at most all of it (a measurement never raises an estimate), and nothing when
    S <= 0: a block whose saving is within the noise is planned as a whole block. Options of random calls only are scaled by the measurement that kept the draws only
    (`keep_draws_saved_ms`) against their own V. 1 when the block was not measured."""
    items = option_items(block)
    measured = block.keep_saved_ms
    if block.keep_draws_saved_ms is not None and _random_only(block, keys):
        items = [op for op in items if op.rng_bytes > 0]
        measured = block.keep_draws_saved_ms
    if measured is None or not items:
        return 1.0
    if measured <= 0:
        return 0.0
    estimate = sum(op_value(op, block, "time", rates) for op in items)
    estimate -= keep_overhead_ms(block, [op.key for op in items], rates)
    return min(1.0, measured / estimate) if estimate > 0 else 1.0


def _net_ms(block: BlockCost, keys: Collection[OpKey], value_ms: float, rates: MachineRates) -> float:
    """The `time` value of keeping `keys` (their `op_value`s add up to `value_ms`): net of the
    fixed cost of keeping, scaled by the block's measurement."""
    if not keys:
        return 0.0
    return keep_calibration(block, keys, rates) * (value_ms - keep_overhead_ms(block, keys, rates))


def step_options(
    cost: StepCost, metric: str, rates: MachineRates | None, max_options: int | None = None
) -> list[tuple[OpOption, ...]]:
    """`block_options` of every block; blocks with identical op lists are solved once (in
    `ms` an op's value also depends on its block's measured time, in `time` on what keeping
    was measured to save)."""
    memo: dict[tuple, tuple[OpOption, ...]] = {}
    out = []
    for blk in cost.blocks:
        if metric == "ms":
            sig: tuple = (blk.ops, blk.fwd_flops, blk.fwd_mem_bytes, blk.fwd_rng_bytes, blk.fwd_ms)
        elif metric == "time":
            sig = (blk.ops, blk.keep_saved_ms, blk.keep_draws_saved_ms)
        else:
            sig = blk.ops
        if sig not in memo:
            memo[sig] = block_options(blk, metric, rates, max_options)
        out.append(memo[sig])
    return out


def validate_keeps(cost: StepCost, segments: Sequence[tuple[int, int]], keeps: Keeps | None) -> dict[int, tuple[OpKey, ...]]:
    """`keeps` checked against the plan and the profile: {block: sorted keys}, empty sets dropped.

    Each block that keeps calls must be a checkpointed segment of its own, and each key
    one of its profiled calls that may be kept (`option_items`).
    """
    if not keeps:
        return {}
    singles = {a for a, b in segments if a == b}
    out: dict[int, tuple[OpKey, ...]] = {}
    for p, keys in keeps.items():
        p = int(p)
        keys = tuple(sorted((str(k[0]), int(k[1])) for k in keys))
        if not keys:
            continue
        if not 0 <= p < cost.n_blocks:
            raise ValueError(f"keeps names block {p}, but the chain has {cost.n_blocks} blocks (0..{cost.n_blocks - 1}).")
        if p not in singles:
            raise ValueError(
                f"keeps names block {p} ({cost.blocks[p].name!r}), which is not a checkpointed segment of its own in "
                f"segments {list(segments)}; only a block checkpointed alone can keep op outputs. Add ({p}, {p}) "
                "to the segments or drop the block from keeps."
            )
        allowed = {op.key for op in option_items(cost.blocks[p])}
        bad = [k for k in keys if k not in allowed]
        if bad:
            raise ValueError(
                f"block {p} ({cost.blocks[p].name!r}) cannot keep {bad}: a kept call must be one the profile saw "
                "that backward saves, that writes new storage (or draws random numbers) and that runs before the "
                f"block's last saved tensor. Its keepable calls are {sorted(allowed)}."
            )
        out[p] = keys
    return out


def kept_bytes(block: BlockCost, keys: Collection[OpKey]) -> int:
    """Bytes `block` holds from forward to backward for its kept calls `keys`."""
    if not keys:  # most blocks keep none: the sum below is 0
        return 0
    want = set(keys)
    return sum(op.keep_bytes for op in block.ops if op.key in want)


def kept_value(block: BlockCost, keys: Collection[OpKey], metric: str, rates: MachineRates | None) -> float:
    """Recompute the kept calls `keys` of `block` avoid, in `metric` (in `time` net of the
    fixed cost of keeping, `keep_overhead_ms`, and scaled by `keep_calibration`)."""
    if not keys:  # most blocks keep none: the value below is 0, `_net_ms`'s 0.0 in `time`
        return 0.0 if metric == "time" and rates is not None else 0
    want = set(keys)
    value = sum(op_value(op, block, metric, rates) for op in block.ops if op.key in want)
    if metric == "time" and rates is not None:
        return _net_ms(block, keys, value, rates)
    return value


def describe_keeps(block: BlockCost, keys: Collection[OpKey]) -> str:
    """"keeps: addmm x4, bernoulli_ x2; recomputes: native_layer_norm x2, gelu" for the table."""
    want = set(keys)
    kept: dict[str, int] = {}
    redo: dict[str, int] = {}
    for op in option_items(block):
        name = _short(op.op)
        side = kept if op.key in want else redo
        side[name] = side.get(name, 0) + 1

    def fmt(d: dict[str, int]) -> str:
        return ", ".join(k if c == 1 else f"{k} x{c}" for k, c in d.items()) or "nothing"

    return f"keeps: {fmt(kept)}; recomputes: {fmt(redo)}"


def _short(op: str) -> str:
    """"aten.addmm.default" -> "addmm"; "aten.bernoulli_.float" -> "bernoulli_"."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op
