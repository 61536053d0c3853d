"""Measure how fast this device does FLOPs, memory-bound bytes and random bytes.

Microbenchmarks on the profiled device and dtypes (bf16 as well as fp32), each a few
milliseconds on a CPU: a square matmul (FLOPs per second), a fixed mix of memory-bound
ops (bytes written per second, counted by the same rule as the profile: `op_bytes`),
dropout's `bernoulli_` (random bytes per second), and the fixed costs of checkpointing:
one region (`segment_s`) and each op call recomputed (`op_call_s`, on a block of tiny ops).
Sizes are fixed per device type, never chosen by a timing; each kernel is warmed up until
its calls settle; the three rates are timed in interleaved rounds and each is the median,
on this thread's CPU time where torch runs on one CPU thread (`step_clock`). On the shared
2-core CPU here, the fastest of 7 calls after one warm-up call (sizes chosen by one timed
call) read 2.3 GB/s memory-bound in a process's first measurement and 10.3-10.9 in the next
ones; on the wall clock, with three other processes on the cores, matmul read 39-101 GFLOP/s.
This way, in the same load: 97-101 GFLOP/s and 8.9-10.4 GB/s (bf16: 360-383, 4.8-5.3).
Global RNG and autocast are left alone. Used by `profiler.profile_model`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.profiling.machine.measured_cache import kept, machine_key
from lightning_ckpt.profiling.work.op_bytes import OpBytesCounter

__all__ = ["TinyOpsBlock", "check_rates_dict", "count_op_calls", "interleaved_medians", "kept_rates", "measure_rates", "step_clock"]

# (matmul side, elements of the memory-bound and random tensors) per device type. On a CPU,
# 2**18 elements (1 MiB in fp32) stay near the core's L2 like a block's activations at small
# widths; 4 MiB ones moved up to 2x between runs with the neighbours' load. GPUs need larger
# calls to hide the kernel launch.
_SIZES = {"cpu": (512, 2**18), "default": (4096, 2**24)}
_ROW = 256  # softmax and layer norm reduce over rows of this many elements
_WARM_CALLS = (3, 20)  # at least / at most this many untimed calls before timing one kernel
_VERSION = 1  # of what `measure_rates` measures: rates kept by another version are measured again


def kept_rates(
    device: str | torch.device = "cpu",
    flop_dtype: str | torch.dtype = torch.float32,
    mem_dtype: str | torch.dtype = torch.float32,
    max_bytes: int | None = None,
) -> MachineRates:
    """`measure_rates` of this machine, kept between runs (`measured_cache`): measured once per
    device, dtypes, thread count and torch version, then read back (`LIGHTNING_CKPT_REMEASURE=1`
    measures again). Each run then plans from the same rates. With `max_bytes`, the kernels are
    made small enough to hold at most that (`rates_sizes`); rates measured smaller are kept apart."""
    device = torch.device(device)
    key = {**machine_key(device), "flop_dtype": str(_dtype(flop_dtype)), "mem_dtype": str(_dtype(mem_dtype)), "version": _VERSION}
    sizes = rates_sizes(device, flop_dtype, mem_dtype, max_bytes)
    smaller = {} if sizes == _SIZES.get(device.type, _SIZES["default"]) else {"sizes": sizes}
    key.update({k: list(v) for k, v in smaller.items()})
    value = kept("rates", key, lambda: measure_rates(device, flop_dtype, mem_dtype, **smaller).to_dict(), check=check_rates_dict)
    return MachineRates.from_dict(value)


def rates_bytes(sizes: tuple[int, int], flop_dtype: str | torch.dtype, mem_dtype: str | torch.dtype) -> int:
    """The most `measure_rates` holds at once with kernels of `sizes` (matmul side, elements): the two
    matrices, the three vectors and the memory-bound mix's two in flight, and one fp32 draw of each
    kind while it is cast to another dtype."""
    side, elements = sizes
    flop, mem = _dtype(flop_dtype), _dtype(mem_dtype)
    drawn = [4 if dtype != torch.float32 else 0 for dtype in (flop, mem)]  # randn's fp32 until `.to`
    return side * side * (2 * flop.itemsize + drawn[0]) + elements * (5 * mem.itemsize + drawn[1])


def rates_sizes(
    device: torch.device, flop_dtype: str | torch.dtype, mem_dtype: str | torch.dtype, max_bytes: int | None
) -> tuple[int, int]:
    """The device's kernel sizes (`_SIZES`), scaled down when they would hold more than `max_bytes`
    (a square side a multiple of 64, elements a multiple of a row; never below one of each)."""
    side, elements = _SIZES.get(device.type, _SIZES["default"])
    need = rates_bytes((side, elements), flop_dtype, mem_dtype)
    if max_bytes is None or need <= max_bytes:
        return side, elements
    share = max(0.0, max_bytes / need)
    return max(64, int(side * math.sqrt(share)) // 64 * 64), max(_ROW, int(elements * share) // _ROW * _ROW)


_RATE_FIELDS = ("flop_per_s", "mem_byte_per_s", "rng_byte_per_s")
_SECONDS_FIELDS = ("segment_s", "op_call_s", "keep_draws_op_s", "keep_ops_op_s")
_TEXT_FIELDS = ("device", "flop_dtype", "mem_dtype")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not a finite number")
    return float(value)


def check_rates_dict(data: object) -> None:
    """Raise `ValueError`/`TypeError` unless `data` is a `MachineRates.to_dict()` as kept between
    runs: exactly its fields, finite positive rates, finite seconds >= 0, no bools for numbers."""
    if not isinstance(data, dict):
        raise TypeError(f"rates are a {type(data).__name__}, not an object of MachineRates fields")
    fields = {f.name for f in dataclasses.fields(MachineRates)}
    if set(data) != fields:
        raise ValueError(f"rates have fields {sorted(set(data) ^ fields)} missing or unknown")
    for name in _RATE_FIELDS:
        if _number(name, data[name]) <= 0:
            raise ValueError(f"{name}={data[name]!r} is not a positive rate")
    for name in _SECONDS_FIELDS:
        if _number(name, data[name]) < 0:
            raise ValueError(f"{name}={data[name]!r} is negative")
    for name in _TEXT_FIELDS:
        if not isinstance(data[name], str):
            raise TypeError(f"{name}={data[name]!r} is not a string")
    gather = data["gather_byte_per_s"]
    if gather is not None and _number("gather_byte_per_s", gather) <= 0:
        raise ValueError(f"gather_byte_per_s={gather!r} is not a positive rate")
    MachineRates.from_dict(data)


def measure_rates(
    device: str | torch.device = "cpu",
    flop_dtype: str | torch.dtype = torch.float32,
    mem_dtype: str | torch.dtype = torch.float32,
    repeats: int = 9,
    min_call_s: float = 5e-4,
    sizes: tuple[int, int] | None = None,
) -> MachineRates:
    """`MachineRates` of `device`: matmul FLOPs/s in `flop_dtype`, bytes/s in `mem_dtype`,
    the median of `repeats` interleaved rounds; each timed call loops a kernel until it
    takes `min_call_s`. Measured on one CPU thread: 1.3 s the first time in a process, 0.3 s after.
    `sizes`: (matmul side, elements) instead of the device's (`rates_sizes`)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1; each rate is the median of that many timed rounds.")
    device = torch.device(device)
    flop_dtype, mem_dtype = _dtype(flop_dtype), _dtype(mem_dtype)
    sync = _synchronizer(device)
    clock = step_clock(device)
    side, elements = sizes or _SIZES.get(device.type, _SIZES["default"])
    gen = torch.Generator(device=device).manual_seed(0)  # the global RNG stays untouched
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        a = torch.randn(side, side, device=device, generator=gen).to(flop_dtype)
        b = torch.randn(side, side, device=device, generator=gen).to(flop_dtype)
        x = torch.randn(elements // _ROW, _ROW, device=device, generator=gen).to(mem_dtype)
        y = torch.randn(elements // _ROW, _ROW, device=device, generator=gen).to(mem_dtype)
        z = torch.empty(elements, device=device, dtype=mem_dtype)

        def mix() -> None:
            F.layer_norm(F.gelu(x) * y + x, (_ROW,)).softmax(dim=-1)

        kernels = {
            "flop": (lambda: torch.mm(a, b), 2.0 * side**3),
            "mem": (mix, float(_count_written(mix)[0])),
            "rng": (lambda: z.bernoulli_(0.9, generator=gen), float(z.numel() * z.element_size())),
        }
        rates = _interleaved_rates(kernels, sync, clock, repeats, min_call_s)
    segment_s = _segment_overhead_s(device, sync, clock, repeats)
    op_call_s = _op_call_overhead_s(device, sync, clock, repeats, segment_s)
    return MachineRates(
        flop_per_s=rates["flop"],
        mem_byte_per_s=rates["mem"],
        rng_byte_per_s=rates["rng"],
        segment_s=segment_s,
        op_call_s=op_call_s,
        device=str(device),
        flop_dtype=str(flop_dtype),
        mem_dtype=str(mem_dtype),
    )


def _interleaved_rates(
    kernels: dict[str, tuple[Callable[[], object], float]],
    sync: Callable[[], None],
    clock: Callable[[], float],
    repeats: int,
    min_call_s: float,
) -> dict[str, float]:
    """Work per second of each kernel: warmed up until its calls settle, then `repeats` rounds
    that time every kernel once (a loop of calls lasting `min_call_s`), in a rotating order;
    the median over rounds (a slow moment hits each kernel in turn, not one of them)."""
    loops = {}
    for name, (fn, _) in kernels.items():
        per_call = _settle(fn, sync, clock)
        loops[name] = max(1, int(min_call_s / max(per_call, 1e-9)) + 1)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    names = list(kernels)
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            fn, n = kernels[name][0], loops[name]
            times[name].append(_timed(lambda: _calls(fn, n), sync, clock) / n)
    return {name: kernels[name][1] / max(statistics.median(times[name]), 1e-12) for name in names}


def _calls(fn: Callable[[], object], n: int) -> None:
    """`fn` called `n` times, each result let go before the next call (a list of them would hold them all)."""
    for _ in range(n):
        fn()


def _settle(fn: Callable[[], object], sync: Callable[[], None], clock: Callable[[], float]) -> float:
    """Call `fn` until two calls in a row agree within 10 % (at least, at most `_WARM_CALLS`);
    the first calls of a process pay kernel setup and fresh pages. Returns the last call's time."""
    least, most = _WARM_CALLS
    last = _timed(fn, sync, clock)
    for k in range(1, most):
        now = _timed(fn, sync, clock)
        if k + 1 >= least and abs(now - last) <= 0.1 * max(now, last):
            return now
        last = now
    return last


def _segment_overhead_s(
    device: torch.device, sync: Callable[[], None], clock: Callable[[], float], repeats: int, calls: int = 20
) -> float:
    """Seconds one non-reentrant checkpoint region adds to a forward + backward, whatever
    it holds: a tiny op's step with and without `torch.utils.checkpoint`, the median of
    `repeats` interleaved rounds of `calls` each, the difference (at least 0)."""
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(8, device=device, requires_grad=True)

    def op(t: torch.Tensor) -> torch.Tensor:
        return t * 2.0

    def plain() -> None:
        op(x).sum().backward()

    def checkpointed() -> None:
        checkpoint(op, x, use_reentrant=False).sum().backward()

    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        t = interleaved_medians({"plain": plain, "checkpointed": checkpointed}, sync, clock, repeats, calls)
    return max(0.0, t["checkpointed"] - t["plain"])


class TinyOpsBlock(torch.nn.Module):
    """Many cheap op calls on 8 elements (the kinds and argument lists of real blocks:
    linear, batch norm, layer norm, activations, views), one dropout-like draw and one
    matmul: what checkpointing and the dispatch modes of an op-level plan cost per op
    call, apart from the work itself."""

    def __init__(self, device: torch.device, n_layers: int = 6) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4, device=device))
        self.lin = torch.nn.Linear(4, 4, device=device)
        self.bn = torch.nn.BatchNorm1d(4, device=device)
        self.n_layers = n_layers

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        y = torch.mm(t.view(2, 4), self.w)
        for _ in range(self.n_layers):
            y = F.gelu(F.layer_norm(self.bn(self.lin(y)), (4,))).transpose(0, 1).contiguous().transpose(0, 1)
        return y * torch.empty_like(y).bernoulli_(0.5)


def count_op_calls(fn: Callable[[], object]) -> int:
    """How many op calls `fn` makes that selective checkpointing numbers (`op_keys.OpCallCounter`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_ckpt.profiling.work.op_keys import OpCallCounter

    counter, seen = OpCallCounter(), [0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if counter.key(func) is not None:
                seen[0] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return seen[0]


def _op_call_overhead_s(
    device: torch.device,
    sync: Callable[[], None],
    clock: Callable[[], float],
    repeats: int,
    segment_s: float,
    calls: int = 10,
) -> float:
    """Seconds each op call adds to a forward + backward when it is recomputed, apart from
    its work: `TinyOpsBlock` checkpointed whole against not, less one region (`segment_s`),
    per op call of its forward; at least 0."""
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(8, device=device, requires_grad=True)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # its draws leave no trace
        block = TinyOpsBlock(device)
        with torch.no_grad():
            n = max(count_op_calls(lambda: block(x)), 1)

        def plain() -> None:
            block(x).sum().backward()

        def checkpointed() -> None:
            checkpoint(block, x, use_reentrant=False).sum().backward()

        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            t = interleaved_medians({"plain": plain, "checkpointed": checkpointed}, sync, clock, repeats, calls)
    return max(0.0, t["checkpointed"] - t["plain"] - segment_s) / n


def interleaved_medians(
    fns: dict[str, Callable[[], None]], sync: Callable[[], None], clock: Callable[[], float], repeats: int, calls: int
) -> dict[str, float]:
    """Seconds per call of each of `fns`: each warmed up, then `repeats` rounds that run every
    one `calls` times, in a rotating order; the median over rounds of each."""
    names = list(fns)

    def loop(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()

        return run

    runs = {name: loop(fn) for name, fn in fns.items()}
    for run in runs.values():
        run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            times[name].append(_timed(runs[name], sync, clock) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock that times work on `device`: on a CPU running torch on one thread, this
    thread's CPU time (time another process holds the core is not the work's: on the shared
    2-core machine here the wall clock made rates swing with the neighbours' load), else
    the wall clock."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _timed(fn: Callable[[], object], sync: Callable[[], None], clock: Callable[[], float]) -> float:
    sync()
    t0 = clock()
    fn()
    sync()
    return clock() - t0


def _count_written(fn: Callable[[], object]) -> tuple[int, int]:
    """(mem_bytes, rng_bytes) `fn` writes, by the profile's own rule."""
    with FlopCounterMode(display=False) as flops, OpBytesCounter(flops) as counter:
        fn()
    return counter.snapshot()


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if sync is None:
        raise ValueError(
            f"cannot time ops on device {device}: torch.{device.type}.synchronize does not exist. "
            "Pass rates=MachineRates(...) to profile_model, or use cost_metric='flops'."
        )
    return lambda: sync(device)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; give e.g. torch.float32 or 'torch.bfloat16'.")
    return found
