"""Measure on the profiled blocks themselves what recomputing one costs and what keeping saves.

The `time` metric values recompute by counted work at microbenchmarked rates and a kept call
by its share of that work; on real blocks both can be far off (Python and dispatch overhead,
the checkpoint's own bookkeeping, the selective modes' cost per op). Here one block of each
distinct op-call list runs alone on the whole batch: not checkpointed, checkpointed keeping
nothing, every keepable call, a lighter choice of them and its random draws only, interleaved
over rounds (`planning.timing_fit.BlockTiming`). What keeping saves beyond the rounds' own
noise lands in `BlockCost.keep_saved_ms` / `keep_draws_saved_ms` (`planning.op_options.
keep_calibration` scales the option values to it); what recomputing costs is fitted into
`MachineRates.op_call_s`, what the selective modes cost into `keep_ops_op_s`
(`planning.timing_fit`). The blocks are timed by `block_timing`, which applies plans to time them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.apply.block_timing import (
    MAX_ROUNDS,
    MIN_ROUNDS,
    BlockCall,
    autocast_now,
    bounded,
    capture_block_calls,
    measure_block,
    measure_keep_overheads,
)
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.op_options import block_options, option_items
from lightning_ckpt.planning.timing_fit import BlockTiming, fit_keep_ops_op_s, fit_op_call_s, with_block_timings
from lightning_ckpt.profiling.structure.batch import batch_size_of
from lightning_ckpt.profiling.machine.measured_cache import kept, machine_key
from lightning_ckpt.profiling.machine.rates import check_rates_dict
from lightning_ckpt.profiling.passes.profile_budget import released
from lightning_ckpt.profiling.forward_state.state import preserved_state
from lightning_ckpt.profiling.memory.tracker import LiveBytesOverLimit, flat_tensors, unique_storage_bytes
from lightning_ckpt.units import format_bytes

__all__ = [
    "BlockCall",
    "calibrated_profile",
    "capture_block_calls",
    "lighter_choice",
    "measure_block",
    "measure_keep_overheads",
    "measure_step_blocks",
]

OpKey = tuple[str, int]
# of what is measured here: calibrations kept by another version are measured again (2: rounds go
# on while a saving is undecided against the bar it must clear, not only against its noise)
_VERSION = 2


def _sharded(blocks: Sequence[nn.Module]) -> bool:
    from lightning_ckpt.profiling.work.gather import sharded_world_size

    return sharded_world_size(blocks) > 1


def measure_step_blocks(
    cost: StepCost,
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: Callable[[Any], Any],
    batch: Any,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    rates: MachineRates | None = None,
    limit_bytes: int | None = None,
    left_out: list[str] | None = None,
) -> dict[int, BlockTiming]:
    """{block index: its `BlockTiming`} for the blocks of `cost` (the step `step_fn(batch)`, at
    `batch`'s size) that have calls to keep. With `rates`, their recompute is timed too, and a
    lighter choice of their calls (`lighter_choice`), and the most frequent kind of block (by
    op-call list; the first in the chain on a tie) is timed when none has calls to keep: the
    fits of `planning.timing_fit` need them. Blocks with
    equal op-call lists (`BlockCost.ops`, as `op_options.step_options` groups them) share one
    measurement, of the first of them. The model's state is left as found.

    Sharded blocks (ZeRO-3, FSDP2) are not measured: a block's backward run alone would start
    collectives that the other ranks do not expect at that moment.

    With `limit_bytes` (what the memory budget leaves beyond what stays resident), the forward that
    captures the blocks' arguments and each block's warm-up run under a tracker with that limit
    (`block_timing.bounded`): a block whose run would hold more, with the arguments kept, is not
    measured (one warning names it, `left_out` gets its name) and is left out, as an unmeasured block is."""
    groups: dict[tuple, list[int]] = {}
    for i, blk in enumerate(cost.blocks):
        if blk.ops:
            groups.setdefault(blk.ops, []).append(i)
    if not groups or _sharded(blocks):
        return {}
    wanted = [ops for ops, members in groups.items() if option_items(cost.blocks[members[0]])]
    recompute = rates is not None
    if not wanted and recompute:
        wanted = [max(groups, key=lambda ops: (len(groups[ops]), -groups[ops][0]))]
    if not wanted:
        return {}
    firsts = [groups[ops][0] for ops in wanted]
    found: dict[int, BlockTiming] = {}
    with preserved_state(model):
        try:
            with bounded(limit_bytes):
                calls = capture_block_calls(blocks, firsts, step_fn, batch)
        except LiveBytesOverLimit:
            released()
            _over_limit(cost, "the forward that captures the blocks' arguments", limit_bytes)
            if left_out is not None:
                left_out.extend(cost.blocks[i].name for i in firsts)
            return {}
        held = unique_storage_bytes(t for c in calls.values() for t in flat_tensors((c.args, c.kwargs)))
        for i in firsts:
            if i not in calls:  # skipped by this forward (it ran in the probes): left unmeasured
                continue
            items = option_items(cost.blocks[i])
            keys = [op.key for op in items]
            draws = [op.key for op in items if op.rng_bytes > 0]
            part = lighter_choice(cost.blocks[i], rates) if recompute else ()
            limit = None if limit_bytes is None else limit_bytes - held
            try:
                timing = measure_block(blocks[i], calls[i], keys, draws, min_rounds, max_rounds, recompute, part, limit)
            except LiveBytesOverLimit:
                released()
                _over_limit(cost, f"block {cost.blocks[i].name} run alone", limit_bytes)
                if left_out is not None:
                    left_out.append(cost.blocks[i].name)
                continue
            for j in groups[cost.blocks[i].ops]:
                found[j] = timing
    return found


def _over_limit(cost: StepCost, what: str, limit_bytes: int | None) -> None:
    warnings.warn(
        f"lightning-ckpt: the keep calibration was stopped: {what} at batch {cost.batch_size} would hold more than "
        f"the {format_bytes(max(0, limit_bytes or 0))} the memory budget leaves it, so what keeping its op outputs "
        "saves is not measured there; op-level plans value it by counted work (raise memory_budget to measure it, "
        "or plan with granularity='block').",
        stacklevel=4,
    )


def lighter_choice(block: BlockCost, rates: MachineRates) -> tuple[OpKey, ...]:
    """The lightest option of `block`'s `time` frontier (`op_options.block_options`, measured
    savings left out) that keeps a call other than a draw and not every keepable call: the
    choice most sensitive to the fixed cost of the selective modes. () when there is none."""
    bare = dataclasses.replace(block, keep_saved_ms=None, keep_draws_saved_ms=None)
    every = {op.key for op in option_items(block)}
    random = {op.key for op in option_items(block) if op.rng_bytes > 0}
    for option in block_options(bare, "time", rates):
        if not set(option.keys) <= random and set(option.keys) != every:
            return option.keys
    return ()


def _calibration_key(
    cost: StepCost, model: nn.Module, blocks: Sequence[nn.Module], rates: MachineRates | None, min_rounds: int, max_rounds: int
) -> dict[str, Any] | None:
    """What the calibration of `cost`'s blocks depends on (None for sharded blocks: never kept)."""
    if _sharded(blocks):
        return None
    device = rates.device if rates is not None else next((p.device for p in model.parameters()), torch.device("cpu"))
    work = repr([(b.ops, b.fwd_flops, b.fwd_mem_bytes, b.fwd_rng_bytes, b.input_bytes) for b in cost.blocks])
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {
        **machine_key(device),
        "batch": cost.batch_size,
        "blocks": hashlib.sha256(work.encode()).hexdigest()[:32],
        "dtypes": dtypes,
        "autocast": [list(map(str, a)) for a in autocast_now()],
        "rates": None if rates is None else rates.to_dict(),
        "rounds": [min_rounds, max_rounds],
        "version": _VERSION,
    }


def _timing(data: dict[str, Any]) -> BlockTiming:
    return BlockTiming(**{**data, "part_keys": tuple((str(op), int(i)) for op, i in data["part_keys"])})


_TIMING_FIELDS = {f.name for f in dataclasses.fields(BlockTiming)}


def _finite(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not a finite number{' or null' if optional else ''}")


def _check_calibration(data: Any) -> None:
    """Raise `ValueError`/`TypeError` unless `data` is a calibration as `calibrated_profile` keeps
    it: block indices to `BlockTiming` fields (exactly those, finite numbers, no bools), and rates
    as `profiling.machine.rates.check_rates_dict` accepts them, or null."""
    if not isinstance(data, dict) or set(data) != {"timings", "rates"}:
        raise ValueError(f"a calibration is an object of 'timings' and 'rates', not {data!r:.80}")
    if not isinstance(data["timings"], dict):
        raise TypeError(f"timings are a {type(data['timings']).__name__}, not an object")
    for index, t in data["timings"].items():
        if not index.isdigit():
            raise ValueError(f"block index {index!r} is not a number")
        if not isinstance(t, dict) or set(t) != _TIMING_FIELDS:
            raise ValueError(f"the timing of block {index} is not an object of exactly {sorted(_TIMING_FIELDS)}")
        for name in ("all_ms", "draws_ms", "recompute_ms", "part_ms"):
            _finite(name, t[name], optional=True)
        _finite("noise_ms", t["noise_ms"])
        if t["noise_ms"] < 0 or isinstance(t["rounds"], bool) or not isinstance(t["rounds"], int) or t["rounds"] < 0:
            raise ValueError(f"block {index}: noise_ms={t['noise_ms']!r} or rounds={t['rounds']!r} is not a count >= 0")
        keys = t["part_keys"]
        if not isinstance(keys, list) or not all(
            isinstance(k, list) and len(k) == 2 and isinstance(k[0], str) and type(k[1]) is int for k in keys
        ):
            raise ValueError(f"block {index}: part_keys={keys!r:.80} are not [op name, call index] pairs")
    if data["rates"] is not None:
        check_rates_dict(data["rates"])


def calibrated_profile(
    profile: Profile,
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: Callable[[Any], Any],
    batch: Any,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    fit_rates: bool = True,
    limit_bytes: int | None = None,
) -> Profile:
    """`profile` with what keeping saves and what recomputing costs, measured on the whole
    `batch` and put into every probe.

    Measured at the batch training runs, not at the small probes: there the fixed cost of
    keeping hides what it saves (the 48-block encoder's block saved -1.8 ms at batch 1,
    -1.6 at 2, 7.4 at 16; the line through the first two predicts 1.5 at 16). Each probe gets
    the saving scaled in proportion to its batch, so `Profile.at` returns it as measured at
    the whole batch and in proportion at others. When the probes carry machine rates and
    `fit_rates` (rates the user gave stay as given), their keeping costs per op call are
    measured (`measure_keep_overheads`) and then `op_call_s` and `keep_ops_op_s` become the
    fits to the measured blocks (`planning.timing_fit`). Each probe's
    `meta["keep_calibration_s"]` says how long the measurement took. What was measured is kept
    between runs (`profiling.machine.measured_cache`) for the same machine, blocks (their counted work),
    batch size, autocast and rates: a later run plans from the same numbers. With `limit_bytes`, every pass
    stays within it (`measure_step_blocks`); a calibration with blocks left out for it is not kept."""
    t0 = time.perf_counter()
    n = batch_size_of(batch)
    cost = profile.at(n)
    base = cost.rates if fit_rates else None

    def measure() -> dict[str, Any]:
        rates = base
        if rates is not None:  # the keeping modes' costs first: the lighter choice is made with them
            draws_s, ops_s = measure_keep_overheads(torch.device(rates.device))
            rates = dataclasses.replace(rates, keep_draws_op_s=draws_s, keep_ops_op_s=ops_s)
        left_out: list[str] = []
        timings = measure_step_blocks(
            cost, model, blocks, step_fn, batch, min_rounds, max_rounds, rates, limit_bytes, left_out
        )
        if timings and rates is not None:
            calls_s, keep_s = fit_op_call_s(cost, timings, rates), fit_keep_ops_op_s(cost, timings, rates)
            rates = dataclasses.replace(
                rates,
                op_call_s=rates.op_call_s if calls_s is None else calls_s,
                keep_ops_op_s=rates.keep_ops_op_s if keep_s is None else keep_s,
            )
        found = {
            "timings": {str(i): dataclasses.asdict(t) for i, t in timings.items()},
            "rates": None if rates is None else rates.to_dict(),
        }
        return {**found, "left_out": left_out} if left_out else found  # (not a calibration to keep)

    key = _calibration_key(cost, model, blocks, base, min_rounds, max_rounds)
    found = kept("keep_calibration", key, measure, check=_check_calibration) if key is not None else measure()
    timings = {int(i): _timing(t) for i, t in found["timings"].items()}
    if not timings:
        return profile
    rates = None if found["rates"] is None else MachineRates.from_dict(found["rates"])
    took = {"keep_calibration_s": time.perf_counter() - t0}

    def put(c: StepCost) -> StepCost:
        c = with_block_timings(c, timings, n)
        meta = {**c.meta, **took, **({"rates": rates.to_dict()} if rates is not None else {})}
        return dataclasses.replace(c, meta=meta)

    a, b = profile.probes
    return Profile(probes=(put(a), put(b)), check=None if profile.check is None else put(profile.check))
