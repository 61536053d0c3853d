"""Measure what keeping op outputs really saves in a block checkpointed alone.

The `time` metric values a kept call by its counted work at the machine rates, less a
fixed cost per op call measured on a tiny block; on real blocks that estimate can be far
off. Here one block of each distinct op-call list runs alone on the whole batch,
checkpointed, keeping nothing, every keepable call, and its random draws only; the time
its forward + backward saves lands in `BlockCost.keep_saved_ms` / `keep_draws_saved_ms`,
against which `planning.op_options.keep_calibration` scales the estimates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_ckpt.planning.costs import StepCost
from lightning_ckpt.planning.linear_fit import Profile
from lightning_ckpt.planning.op_options import option_items
from lightning_ckpt.profiling.batch import batch_size_of, first_tensor
from lightning_ckpt.profiling.state import preserved_state

__all__ = [
    "BlockCall",
    "KeepSavings",
    "calibrated_profile",
    "capture_block_calls",
    "measure_keep_savings",
    "measure_step_savings",
    "with_keep_savings",
]

OpKey = tuple[str, int]

# Timed rounds per distinct block, after one untimed step. Each round runs the block's
# forward + backward once per variant (2 or 3), in a rotating order. On the shared 2-core
# CPU, 5 rounds gave the encoder block 7.26 / 7.37 / 7.27 ms in three runs at batch 16.
ROUNDS = 4


@dataclass(frozen=True)
class KeepSavings:
    """What keeping saves in one forward + backward of a block checkpointed alone, in ms.

    all_ms: keeping every keepable call (`op_options.option_items`) over keeping nothing.
    draws_ms: keeping only its random calls; None when it has none to keep.
    Either may be negative: keeping then cost more time than it saved.
    """

    all_ms: float
    draws_ms: float | None


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


def measure_keep_savings(
    block: nn.Module,
    call: BlockCall,
    all_keys: Collection[OpKey],
    draw_keys: Collection[OpKey] = (),
    rounds: int = ROUNDS,
) -> KeepSavings:
    """Time `block`'s forward + backward checkpointed alone (`apply_segments([block], [(0, 0)])`)
    with nothing kept, with `all_keys` kept and with `draw_keys` kept, interleaved over `rounds`;
    each saving is the median over rounds of that round's difference to keeping nothing.

    The block's first tensor argument is a detached copy that requires grad (when floating).
    RNG states, the block's buffers (BatchNorm statistics) and its parameters' `.grad` are as
    they were afterwards."""
    from lightning_ckpt.apply import apply_segments

    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1; each saving is a median over that many rounds.")
    all_keys, draw_keys = frozenset(all_keys), frozenset(draw_keys)
    if not all_keys:
        raise ValueError("all_keys is empty: there is nothing to keep, so there is no saving to measure.")
    if not draw_keys <= all_keys:
        raise ValueError(
            f"draw_keys {sorted(draw_keys - all_keys)} are not in all_keys; the draws are keepable calls too."
        )
    variants: dict[str, dict[int, frozenset[OpKey]]] = {"none": {}, "all": {0: all_keys}}
    if draw_keys and draw_keys != all_keys:
        variants["draws"] = {0: draw_keys}
    x = first_tensor(call.args)
    device = x.device if x is not None else next((p.device for p in block.parameters()), None)
    sync = _synchronizer(device)
    params = [p for p in block.parameters() if p.requires_grad]

    def fresh(v: Any) -> Any:  # the block's input, as a leaf of its own (its gradient is computed, as in the step)
        if x is None or v is not x:
            return v
        v = v.detach().clone()
        return v.requires_grad_() if v.is_floating_point() or v.is_complex() else v

    args = tuple(fresh(a) for a in call.args)
    kwargs = {k: fresh(v) for k, v in call.kwargs.items()}

    def step(keep: dict[int, frozenset[OpKey]]) -> float:
        handle = apply_segments([block], [(0, 0)], keep_ops=keep or None)
        try:
            for t in (*params, *(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))):
                t.grad = None
            with contextlib.ExitStack() as stack:
                for device_type, dtype in call.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                sync()
                t0 = time.perf_counter()
                out = first_tensor(block(*args, **kwargs))
                if out is None or not out.requires_grad:
                    raise ValueError(
                        f"block {type(block).__name__} returned no tensor that requires grad when called alone with "
                        "its profiled arguments, so its backward cannot be timed; profile with calibrate_keeps=False."
                    )
            out.backward(torch.ones_like(out))
            sync()
            return (time.perf_counter() - t0) * 1e3
        finally:
            handle.remove()

    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    with preserved_state(block), torch.enable_grad():  # RNG streams, buffers and grads put back
        step(variants["all"])  # warm-up: kernels chosen, allocator settled, the kept keys checked
        for r in range(rounds):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]  # rotating order: a slow moment hits each in turn
                times[name].append(step(variants[name]))

    def saved(name: str) -> float:
        return statistics.median(a - b for a, b in zip(times["none"], times[name]))

    all_ms = saved("all")
    draws_ms = None if not draw_keys else saved("draws") if "draws" in variants else all_ms
    return KeepSavings(all_ms=all_ms, draws_ms=draws_ms)


def _sharded(blocks: Sequence[nn.Module]) -> bool:
    from lightning_ckpt.profiling.gather import sharded_world_size

    return sharded_world_size(blocks) > 1


def measure_step_savings(
    cost: StepCost,
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: Callable[[Any], Any],
    batch: Any,
    rounds: int = ROUNDS,
) -> dict[int, KeepSavings]:
    """{block index: what keeping saves} for every block of `cost` (the step `step_fn(batch)`,
    at `batch`'s size) that has calls to keep. Blocks with equal op-call lists (`BlockCost.ops`,
    as `op_options.step_options` groups them) share one measurement, of the first of them.
    The model's state is left as found.

    Sharded blocks (ZeRO-3, FSDP2) are not measured: a block's backward run alone would start
    collectives that the other ranks do not expect at that moment."""
    groups: dict[tuple, list[int]] = {}
    for i, blk in enumerate(cost.blocks):
        if option_items(blk):
            groups.setdefault(blk.ops, []).append(i)
    if not groups or _sharded(blocks):
        return {}
    firsts = [members[0] for members in groups.values()]
    found: dict[int, KeepSavings] = {}
    with preserved_state(model):
        calls = capture_block_calls(blocks, firsts, step_fn, batch)
        for i in firsts:
            if i not in calls:  # skipped by this forward (it ran in the probes): left unmeasured
                continue
            items = option_items(cost.blocks[i])
            keys = [op.key for op in items]
            draws = [op.key for op in items if op.rng_bytes > 0]
            saving = measure_keep_savings(blocks[i], calls[i], keys, draws, rounds)
            for j in groups[cost.blocks[i].ops]:
                found[j] = saving
    return found


def with_keep_savings(cost: StepCost, savings: Mapping[int, KeepSavings], measured_batch: int) -> StepCost:
    """`cost` with `savings` (measured at batch `measured_batch`) in its blocks' `keep_saved_ms`
    and `keep_draws_saved_ms`, scaled to `cost.batch_size` in proportion to the batch."""
    if measured_batch < 1:
        raise ValueError(f"measured_batch={measured_batch} must be a positive batch size.")
    scale = cost.batch_size / measured_batch

    def scaled(v: float | None) -> float | None:
        return None if v is None else v * scale

    blocks = tuple(
        b if i not in savings else dataclasses.replace(
            b, keep_saved_ms=scaled(savings[i].all_ms), keep_draws_saved_ms=scaled(savings[i].draws_ms)
        )
        for i, b in enumerate(cost.blocks)
    )
    return dataclasses.replace(cost, blocks=blocks)


def calibrated_profile(
    profile: Profile,
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: Callable[[Any], Any],
    batch: Any,
    rounds: int = ROUNDS,
) -> Profile:
    """`profile` with what keeping saves, measured on the whole `batch` and put into every probe.

    Measured at the batch training runs, not at the small probes: there the fixed cost of
    keeping hides what it saves (the 48-block encoder's block saved -1.8 ms at batch 1,
    -1.6 at 2, 7.4 at 16; the line through the first two predicts 1.5 at 16). Each probe gets
    the saving scaled in proportion to its batch, so `Profile.at` returns it as measured at
    the whole batch and in proportion at others. Each probe's `meta["keep_calibration_s"]`
    says how long the measurement took."""
    t0 = time.perf_counter()
    n = batch_size_of(batch)
    savings = measure_step_savings(profile.at(n), model, blocks, step_fn, batch, rounds)
    if not savings:
        return profile
    took = {"keep_calibration_s": time.perf_counter() - t0}

    def put(cost: StepCost) -> StepCost:
        cost = with_keep_savings(cost, savings, n)
        return dataclasses.replace(cost, meta={**cost.meta, **took})

    a, b = profile.probes
    return Profile(probes=(put(a), put(b)), check=None if profile.check is None else put(profile.check))
