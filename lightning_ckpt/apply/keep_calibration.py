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
(`planning.timing_fit`). It applies plans to time them (`apply`), so it sits above
profiling and planning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.op_options import block_options, option_items
from lightning_ckpt.planning.timing_fit import BlockTiming, fit_keep_ops_op_s, fit_op_call_s, with_block_timings
from lightning_ckpt.profiling.batch import batch_size_of, first_tensor
from lightning_ckpt.profiling.measured_cache import kept, machine_key
from lightning_ckpt.profiling.rates import TinyOpsBlock, count_op_calls, step_clock
from lightning_ckpt.profiling.state import preserved_state

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

# Timed rounds per distinct block, after one untimed step of each variant. Each round runs the
# block's forward + backward once per variant (2 to 4), in a rotating order. Rounds go on past
# MIN_ROUNDS, up to MAX_ROUNDS, while a saving is still within its noise. On the shared 2-core
# CPU with three other processes on it, a round's difference of two variants of an HF BERT-48
# block (30-40 ms each at batch 16) moved by 3-4 ms: its savings of about 1 ms stayed within
# the noise of 12 rounds (2 s of measuring), and the block planned block-level.
MIN_ROUNDS = 5
MAX_ROUNDS = 12
# A saving counts as measured only beyond this many standard errors of its median.
NOISE_SE = 2.0
_VERSION = 1  # of what is measured here: calibrations kept by another version are measured again


@dataclass(frozen=True)
class BlockCall:
    """How a block was called in the step: its arguments and the autocast it ran under.

    args, kwargs: copies of what it received (the tensors detached).
    autocast: (device type, dtype) of each autocast that was on.
    """

    args: tuple
    kwargs: dict
    autocast: tuple[tuple[str, torch.dtype], ...] = ()


def _autocast_now() -> tuple[tuple[str, torch.dtype], ...]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return tuple((d, torch.get_autocast_dtype(d)) for d in devices if torch.is_autocast_enabled(d))


def _copy(value: Any) -> Any:
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, value)


class _AllCaptured(Exception):
    """Raised from a block's pre-hook once every call wanted is captured: the rest of the forward is skipped."""


def capture_block_calls(
    blocks: Sequence[nn.Module], indices: Collection[int], step_fn: Callable[[Any], Any], batch: Any
) -> dict[int, BlockCall]:
    """The calls of `blocks[i]`, i in `indices`, in one forward of `step_fn(batch)` without grad,
    stopped once all are seen. Changes what that forward changes (RNG, BatchNorm statistics):
    run it under `preserved_state`."""
    wanted = set(indices)
    found: dict[int, BlockCall] = {}
    handles = []
    for i in wanted:

        def pre(module, args, kwargs, i=i):
            found.setdefault(i, BlockCall(_copy(tuple(args)), _copy(dict(kwargs)), _autocast_now()))
            if len(found) == len(wanted):
                raise _AllCaptured

        handles.append(blocks[i].register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            step_fn(batch)
    except _AllCaptured:
        pass
    finally:
        for h in handles:
            h.remove()
    return found


def _synchronizer(device: torch.device | None) -> Callable[[], None]:
    if device is None or device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.synchronize(device)


def _median_noise(diffs: Sequence[float]) -> float:
    """`NOISE_SE` standard errors of the median of `diffs`, from their spread (the median
    absolute deviation, scaled to a standard deviation; the median's error is 1.25 sd / sqrt(n))."""
    if len(diffs) < 2:
        return float("inf")
    mid = statistics.median(diffs)
    sd = 1.4826 * statistics.median(abs(d - mid) for d in diffs)
    return NOISE_SE * 1.2533 * sd / len(diffs) ** 0.5


def measure_block(
    block: nn.Module,
    call: BlockCall,
    all_keys: Collection[OpKey] = (),
    draw_keys: Collection[OpKey] = (),
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    recompute: bool = True,
    part_keys: Collection[OpKey] = (),
) -> BlockTiming:
    """Time `block`'s forward + backward checkpointed alone (`apply_segments([block], [(0, 0)])`)
    with nothing kept, with `all_keys` kept, with `draw_keys` kept, with `part_keys` kept and
    (with `recompute`) not checkpointed, interleaved over `min_rounds` to `max_rounds` rounds (more while a saving is
    within its noise); each result is the median over rounds of that round's difference.

    The block's first tensor argument is a detached copy that requires grad (when floating).
    RNG states, the block's buffers (BatchNorm statistics) and its parameters' `.grad` are as
    they were afterwards."""
    if min_rounds < 1 or max_rounds < min_rounds:
        raise ValueError(
            f"min_rounds={min_rounds}, max_rounds={max_rounds}: need 1 <= min_rounds <= max_rounds; each "
            "result is a median over that many rounds."
        )
    all_keys, draw_keys, part_keys = frozenset(all_keys), frozenset(draw_keys), frozenset(part_keys)
    if not all_keys and not recompute:
        raise ValueError("all_keys is empty and recompute=False: there is nothing to measure.")
    if not draw_keys <= all_keys or not part_keys <= all_keys:
        wrong = sorted((draw_keys | part_keys) - all_keys)
        raise ValueError(f"draw_keys or part_keys {wrong} are not in all_keys; they choose among the keepable calls.")
    variants: dict[str, dict[int, frozenset[OpKey]] | None] = {"none": {}}
    if all_keys:
        variants["all"] = {0: all_keys}
    if draw_keys and draw_keys != all_keys:
        variants["draws"] = {0: draw_keys}
    if part_keys and part_keys != all_keys:
        variants["part"] = {0: part_keys}
    if recompute:
        variants["plain"] = None  # not checkpointed
    x = first_tensor(call.args)
    device = x.device if x is not None else next((p.device for p in block.parameters()), None)
    sync = _synchronizer(device)
    clock = step_clock(device if device is not None else torch.device("cpu"))
    params = [p for p in block.parameters() if p.requires_grad]

    def fresh(v: Any) -> Any:  # the block's input, as a leaf of its own (its gradient is computed, as in the step)
        if x is None or v is not x:
            return v
        v = v.detach().clone()
        return v.requires_grad_() if v.is_floating_point() or v.is_complex() else v

    args = tuple(fresh(a) for a in call.args)
    kwargs = {k: fresh(v) for k, v in call.kwargs.items()}

    def step(keep: dict[int, frozenset[OpKey]] | None) -> float:
        handle = None if keep is None else apply_segments([block], [(0, 0)], keep_ops=keep or None)
        try:
            for t in (*params, *(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))):
                t.grad = None
            with contextlib.ExitStack() as stack:
                for device_type, dtype in call.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                sync()
                t0 = clock()
                out = first_tensor(block(*args, **kwargs))
                if out is None or not out.requires_grad:
                    raise ValueError(
                        f"block {type(block).__name__} returned no tensor that requires grad when called alone with "
                        "its profiled arguments, so its backward cannot be timed; profile with calibrate_keeps=False."
                    )
            out.backward(torch.ones_like(out))
            sync()
            return (clock() - t0) * 1e3
        finally:
            if handle is not None:
                handle.remove()

    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}

    def diffs(name: str, sign: int = 1) -> list[float]:
        return [sign * (a - b) for a, b in zip(times["none"], times[name])]

    def undecided() -> bool:  # a saving still within its noise: more rounds may tell
        return any(abs(statistics.median(diffs(n))) <= _median_noise(diffs(n)) for n in ("all", "draws") if n in times)

    with preserved_state(block), torch.enable_grad():  # RNG streams, buffers and grads put back
        for name in names:  # warm-up: kernels chosen, allocator settled, the kept keys checked
            step(variants[name])
        r = 0
        while r < min_rounds or (r < max_rounds and undecided()):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]  # rotating order: a slow moment hits each in turn
                times[name].append(step(variants[name]))
            r += 1

    def saved(name: str) -> float | None:
        return statistics.median(diffs(name)) if name in times else None

    all_ms = saved("all")
    draws_ms = None if not draw_keys else saved("draws") if "draws" in variants else all_ms
    noise = max((_median_noise(diffs(n)) for n in ("all", "draws") if n in times), default=0.0)
    recompute_ms = saved("plain") if recompute else None  # "none" over "plain"
    part = tuple(sorted(part_keys)) if "part" in variants else ()
    return BlockTiming(
        all_ms=all_ms, draws_ms=draws_ms, noise_ms=noise, recompute_ms=recompute_ms, rounds=r,
        part_keys=part, part_ms=saved("part") if part else None,
    )


def _sharded(blocks: Sequence[nn.Module]) -> bool:
    from lightning_ckpt.profiling.gather import sharded_world_size

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
) -> dict[int, BlockTiming]:
    """{block index: its `BlockTiming`} for the blocks of `cost` (the step `step_fn(batch)`, at
    `batch`'s size) that have calls to keep. With `rates`, their recompute is timed too, and a
    lighter choice of their calls (`lighter_choice`), and the most frequent kind of block (by
    op-call list; the first in the chain on a tie) is timed when none has calls to keep: the
    fits of `planning.timing_fit` need them. Blocks with
    equal op-call lists (`BlockCost.ops`, as `op_options.step_options` groups them) share one
    measurement, of the first of them. The model's state is left as found.

    Sharded blocks (ZeRO-3, FSDP2) are not measured: a block's backward run alone would start
    collectives that the other ranks do not expect at that moment."""
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
        calls = capture_block_calls(blocks, firsts, step_fn, batch)
        for i in firsts:
            if i not in calls:  # skipped by this forward (it ran in the probes): left unmeasured
                continue
            items = option_items(cost.blocks[i])
            keys = [op.key for op in items]
            draws = [op.key for op in items if op.rng_bytes > 0]
            part = lighter_choice(cost.blocks[i], rates) if recompute else ()
            timing = measure_block(blocks[i], calls[i], keys, draws, min_rounds, max_rounds, recompute, part)
            for j in groups[cost.blocks[i].ops]:
                found[j] = timing
    return found


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


def measure_keep_overheads(device: torch.device, repeats: int = 7, calls: int = 10) -> tuple[float, float]:
    """(keep_draws_op_s, keep_ops_op_s): seconds per op call that an op-level block adds to a
    forward + backward over the same block checkpointed whole, keeping its draw only, or its
    draw and its matmul (torch's selective checkpoint modes too): `rates.TinyOpsBlock`, the
    median of `repeats` interleaved rounds (`MachineRates.keep_draws_op_s`, `keep_ops_op_s`)."""
    sync, clock = _synchronizer(device), step_clock(device)
    x = torch.ones(8, device=device, requires_grad=True)
    draw, mm = ("aten.bernoulli_.float", 0), ("aten.mm.default", 0)
    keeps = {"whole": {}, "draws": {0: {draw}}, "ops": {0: {draw, mm}}}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # its draws leave no trace
        block = TinyOpsBlock(device)
        with torch.no_grad():
            n = max(count_op_calls(lambda: block(x)), 1)
        times: dict[str, list[float]] = {name: [] for name in keeps}
        names = list(keeps)
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            for r in range(repeats + 1):  # round 0 warms up
                for k in range(len(names)):
                    name = names[(r + k) % len(names)]
                    handle = apply_segments([block], [(0, 0)], keep_ops=keeps[name] or None)
                    try:
                        block(x).sum().backward()  # untimed: the first forward checks the kept keys
                        sync()
                        t0 = clock()
                        for _ in range(calls):
                            block(x).sum().backward()
                        sync()
                        if r:
                            times[name].append((clock() - t0) / calls)
                    finally:
                        handle.remove()
        t = {name: statistics.median(v) for name, v in times.items()}
    return max(0.0, t["draws"] - t["whole"]) / n, max(0.0, t["ops"] - t["whole"]) / n


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
        "autocast": [list(map(str, a)) for a in _autocast_now()],
        "rates": None if rates is None else rates.to_dict(),
        "rounds": [min_rounds, max_rounds],
        "version": _VERSION,
    }


def _timing(data: dict[str, Any]) -> BlockTiming:
    return BlockTiming(**{**data, "part_keys": tuple((str(op), int(i)) for op, i in data["part_keys"])})


def calibrated_profile(
    profile: Profile,
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: Callable[[Any], Any],
    batch: Any,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    fit_rates: bool = True,
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
    between runs (`profiling.measured_cache`) for the same machine, blocks (their counted work),
    batch size, autocast and rates: a later run plans from the same numbers."""
    t0 = time.perf_counter()
    n = batch_size_of(batch)
    cost = profile.at(n)
    base = cost.rates if fit_rates else None

    def measure() -> dict[str, Any]:
        rates = base
        if rates is not None:  # the keeping modes' costs first: the lighter choice is made with them
            draws_s, ops_s = measure_keep_overheads(torch.device(rates.device))
            rates = dataclasses.replace(rates, keep_draws_op_s=draws_s, keep_ops_op_s=ops_s)
        timings = measure_step_blocks(cost, model, blocks, step_fn, batch, min_rounds, max_rounds, rates)
        if timings and rates is not None:
            calls_s, keep_s = fit_op_call_s(cost, timings, rates), fit_keep_ops_op_s(cost, timings, rates)
            rates = dataclasses.replace(
                rates,
                op_call_s=rates.op_call_s if calls_s is None else calls_s,
                keep_ops_op_s=rates.keep_ops_op_s if keep_s is None else keep_s,
            )
        return {
            "timings": {str(i): dataclasses.asdict(t) for i, t in timings.items()},
            "rates": None if rates is None else rates.to_dict(),
        }

    key = _calibration_key(cost, model, blocks, base, min_rounds, max_rounds)
    found = kept("keep_calibration", key, measure) if key is not None else measure()
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
