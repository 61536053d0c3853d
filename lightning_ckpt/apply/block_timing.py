"""Time one block alone, as training would run it: its calls captured from a real step
(`capture_block_calls`), then its forward + backward under several plans, interleaved over rounds
until what keeping saves stands out of the rounds' noise (`measure_block`); and the fixed cost per
op call of the selective modes (`measure_keep_overheads`). `keep_calibration` turns these
measurements into a profile's values.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.planning.timing_fit import BlockTiming, saving_undecided
from lightning_ckpt.profiling.structure.batch import first_tensor
from lightning_ckpt.profiling.structure.block_calls import CallSites, hook_calls
from lightning_ckpt.profiling.machine.rates import TinyOpsBlock, count_op_calls, step_clock
from lightning_ckpt.profiling.forward_state.state import preserved_state
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker, storage_bytes

OpKey = tuple[str, int]

# Timed rounds per distinct block, after one untimed step of each variant. Each round runs the
# block's forward + backward once per variant (2 to 4), in a rotating order. Rounds go on past
# MIN_ROUNDS, up to MAX_ROUNDS, while a saving's noise band holds the bar it must clear to count
# (`timing_fit.saving_undecided`). On the shared 2-core
# CPU with three other processes on it, a round's difference of two variants of an HF BERT-48
# block (30-40 ms each at batch 16) moved by 3-4 ms: its savings of about 1 ms stayed within
# the noise of 12 rounds (2 s of measuring), and the block planned block-level.
MIN_ROUNDS = 5
MAX_ROUNDS = 12
# A saving counts as measured only beyond this many standard errors of its median.
NOISE_SE = 2.0


@dataclass(frozen=True)
class BlockCall:
    """How a block was called in the step: its arguments and the autocast it ran under.

    args, kwargs: copies of what it received (the tensors detached).
    autocast: (device type, dtype) of each autocast that was on.
    """

    args: tuple
    kwargs: dict
    autocast: tuple[tuple[str, torch.dtype], ...] = ()


def autocast_now() -> tuple[tuple[str, torch.dtype], ...]:
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

    def pre(i, module, args, kwargs):
        if i in wanted:
            found.setdefault(i, BlockCall(_copy(tuple(args)), _copy(dict(kwargs)), autocast_now()))
        if len(found) == len(wanted):
            raise _AllCaptured

    handles = hook_calls(CallSites(blocks, grad_only=False), pre, with_kwargs=True)  # every call counts: no grad
    try:
        with torch.no_grad():
            step_fn(batch)
    except _AllCaptured:
        pass
    finally:
        for h in handles:
            h.remove()
    return found


@contextlib.contextmanager
def bounded(limit_bytes: int | None) -> Iterator[None]:
    """Run under a live-bytes tracker that stops the op taking what it holds over `limit_bytes`
    (`LiveBytesOverLimit`); nothing with None. A limit below zero stops at the first new storage."""
    if limit_bytes is None:
        yield
        return
    tracker = LiveBytesTracker()
    tracker.limit_bytes = max(0, limit_bytes)
    with tracker:
        yield


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
    limit_bytes: int | None = None,
) -> BlockTiming:
    """Time `block`'s forward + backward checkpointed alone (`apply_segments([block], [(0, 0)])`)
    with nothing kept, with `all_keys` kept, with `draw_keys` kept, with `part_keys` kept and
    (with `recompute`) not checkpointed, interleaved over `min_rounds` to `max_rounds` rounds (more while
    a saving's noise band holds the bar it must clear to count, `timing_fit.saving_undecided`: the rounds
    stop on the rule the savings are read by); each result is the median over rounds of that round's difference.

    The block's first tensor argument is a detached copy that requires grad (when floating).
    RNG states, the block's buffers (BatchNorm statistics) and its parameters' `.grad` are as
    they were afterwards. With `limit_bytes`, the warm-up step of every variant runs under a live-bytes
    tracker that stops it (`LiveBytesOverLimit`, before any timed round) where it, with that copy, would
    hold more than `limit_bytes` beyond what existed before: the timed rounds hold what the warm-up did."""
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
    copied = 0 if x is None else storage_bytes(x)

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

    keeping = [n for n in ("all", "draws") if n in times]

    def undecided() -> bool:  # a saving whose noise band holds the bar it must clear: more rounds may tell
        noise = max(_median_noise(diffs(n)) for n in keeping)  # as `BlockTiming.noise_ms`
        recompute = statistics.median(diffs("plain")) if "plain" in times else None
        return any(saving_undecided(statistics.median(diffs(n)), noise, recompute) for n in keeping)

    with preserved_state(block), torch.enable_grad():  # RNG streams, buffers and grads put back
        with bounded(None if limit_bytes is None else limit_bytes - copied):
            for name in names:  # warm-up: kernels chosen, allocator settled, the kept keys checked
                step(variants[name])
        r = 0
        while r < min_rounds or (r < max_rounds and keeping and undecided()):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]  # rotating order: a slow moment hits each in turn
                times[name].append(step(variants[name]))
            r += 1

    def saved(name: str) -> float | None:
        return statistics.median(diffs(name)) if name in times else None

    all_ms = saved("all")
    draws_ms = None if not draw_keys else saved("draws") if "draws" in variants else all_ms
    noise = max((_median_noise(diffs(n)) for n in keeping), default=0.0)
    recompute_ms = saved("plain") if recompute else None  # "none" over "plain"
    part = tuple(sorted(part_keys)) if "part" in variants else ()
    return BlockTiming(
        all_ms=all_ms, draws_ms=draws_ms, noise_ms=noise, recompute_ms=recompute_ms, rounds=r,
        part_keys=part, part_ms=saved("part") if part else None,
    )


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
