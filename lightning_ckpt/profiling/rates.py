"""Measure how fast this device does FLOPs, memory-bound bytes and random bytes.

Three microbenchmarks on the profiled device and dtype, each a few milliseconds on
a CPU: a square matmul (FLOPs per second), a fixed mix of memory-bound ops (bytes
written per second, counted by the same rule as the profile: `op_bytes`), and
dropout's `bernoulli_` (random bytes per second). Each size grows until one call
takes `min_call_s`; the rate is that of the fastest of `repeats` timed calls after a
warm-up (other processes only ever add time: on a shared 2-core machine the fastest
call varied 2-7 % across runs for matmul and up to 20 % for the mix, the median up to 2x).
Global RNG and autocast are left alone. Used by `profiler.profile_model`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt.planning.machine_rates import MachineRates
from lightning_ckpt.profiling.op_bytes import OpBytesCounter

__all__ = ["measure_rates"]

_MATMUL_SIZES = (256, 512, 1024, 2048, 4096)
# From 2**18 elements (1 MiB in fp32): on the shared 2-core CPU here, 4 MiB tensors
# (past the core's L2) gave rates that moved up to 2x between runs with the load of
# neighbouring processes; 1 MiB ones moved 5 %. Bigger sizes are for GPUs, where one
# call must be long enough to hide the kernel launch.
_ELEMENT_COUNTS = (2**18, 2**20, 2**22, 2**24)
_ROW = 256  # softmax and layer norm reduce over rows of this many elements


def measure_rates(
    device: str | torch.device = "cpu",
    flop_dtype: str | torch.dtype = torch.float32,
    mem_dtype: str | torch.dtype = torch.float32,
    repeats: int = 7,
    min_call_s: float = 5e-4,
) -> MachineRates:
    """`MachineRates` of `device`: matmul FLOPs/s in `flop_dtype`, bytes/s in `mem_dtype`.

    About 40 ms on one CPU thread; the very first call of a process takes up to a second
    more while torch sets up its kernels (after a profile's probes it is warm).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1; the rate is that of the fastest of that many timed calls.")
    device = torch.device(device)
    flop_dtype, mem_dtype = _dtype(flop_dtype), _dtype(mem_dtype)
    sync = _synchronizer(device)
    gen = torch.Generator(device=device).manual_seed(0)  # the global RNG stays untouched
    with torch.no_grad(), torch.autocast(device.type, enabled=False):

        def matmul(n: int):
            a = torch.randn(n, n, device=device, generator=gen).to(flop_dtype)
            b = torch.randn(n, n, device=device, generator=gen).to(flop_dtype)
            return (lambda: torch.mm(a, b)), 2.0 * n**3

        def memory(n: int):
            x = torch.randn(n // _ROW, _ROW, device=device, generator=gen).to(mem_dtype)
            y = torch.randn(n // _ROW, _ROW, device=device, generator=gen).to(mem_dtype)

            def mix():
                F.layer_norm(F.gelu(x) * y + x, (_ROW,)).softmax(dim=-1)

            return mix, float(_count_written(mix)[0])

        def random(n: int):
            x = torch.empty(n, device=device, dtype=mem_dtype)
            return (lambda: x.bernoulli_(0.9, generator=gen)), float(n * x.element_size())

        flop_per_s = _rate(matmul, _MATMUL_SIZES, sync, repeats, min_call_s)
        mem_byte_per_s = _rate(memory, _ELEMENT_COUNTS, sync, repeats, min_call_s)
        rng_byte_per_s = _rate(random, _ELEMENT_COUNTS, sync, repeats, min_call_s)
    segment_s = _segment_overhead_s(device, sync, repeats)
    keep_draws_op_s, keep_ops_op_s = _keep_overhead_s(device, sync, repeats)
    return MachineRates(
        flop_per_s=flop_per_s,
        mem_byte_per_s=mem_byte_per_s,
        rng_byte_per_s=rng_byte_per_s,
        segment_s=segment_s,
        keep_draws_op_s=keep_draws_op_s,
        keep_ops_op_s=keep_ops_op_s,
        device=str(device),
        flop_dtype=str(flop_dtype),
        mem_dtype=str(mem_dtype),
    )


def _segment_overhead_s(device: torch.device, sync: Callable[[], None], repeats: int, calls: int = 20) -> float:
    """Seconds one non-reentrant checkpoint region adds to a forward + backward, whatever
    it holds: a tiny op's step with and without `torch.utils.checkpoint`, fastest of
    `repeats` loops of `calls` each, the difference (at least 0)."""
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(8, device=device, requires_grad=True)

    def op(t: torch.Tensor) -> torch.Tensor:
        return t * 2.0

    def plain() -> None:
        op(x).sum().backward()

    def checkpointed() -> None:
        checkpoint(op, x, use_reentrant=False).sum().backward()

    def loop(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()

        return run

    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        times = {}
        for name, fn in (("plain", loop(plain)), ("checkpointed", loop(checkpointed))):
            fn()  # warm-up
            sync()
            times[name] = min(_timed(fn, sync) for _ in range(repeats)) / calls
    return max(0.0, times["checkpointed"] - times["plain"])


class _TinyBlock(torch.nn.Module):
    """Many cheap op calls on 8 elements (the kinds and argument lists of real blocks:
    linear, batch norm, layer norm, activations, views), one dropout-like draw and one
    matmul: what the dispatch modes of an op-level plan cost per op call, apart from the
    work itself."""

    def __init__(self, device: torch.device, n_layers: int) -> None:
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


def _keep_overhead_s(device: torch.device, sync: Callable[[], None], repeats: int, calls: int = 10) -> tuple[float, float]:
    """(keep_draws_op_s, keep_ops_op_s): seconds per op call that an op-level block adds to a
    forward + backward over the same block checkpointed whole, keeping its draw only, or its
    draw and its matmul (torch's selective checkpoint modes too); fastest of `repeats` loops."""
    from lightning_ckpt.apply import apply_segments
    from lightning_ckpt.profiling.op_keys import OpCallCounter

    x = torch.ones(8, device=device, requires_grad=True)
    counter, seen = OpCallCounter(), []

    class _Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            key = counter.key(func)
            if key is not None:
                seen.append(key)
            return func(*args, **(kwargs or {}))

    draw, mm = ("aten.bernoulli_.float", 0), ("aten.mm.default", 0)
    keeps = {"whole": {}, "draws": {0: {draw}}, "ops": {0: {draw, mm}}}
    times = {}
    # the block draws from the device's default generator: put it (and the CPU's) back
    state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        block = _TinyBlock(device, 6)  # its initialisation draws too
        with torch.no_grad(), _Count():
            block(x)
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            for name, keep in keeps.items():
                handle = apply_segments([block], [(0, 0)], keep_ops=keep)
                try:
                    def run() -> None:
                        for _ in range(calls):
                            block(x).sum().backward()

                    run()  # warm-up
                    sync()
                    times[name] = min(_timed(run, sync) for _ in range(repeats)) / calls
                finally:
                    handle.remove()
    finally:
        torch.set_rng_state(state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
    n = max(len(seen), 1)
    return max(0.0, times["draws"] - times["whole"]) / n, max(0.0, times["ops"] - times["whole"]) / n


def _rate(make: Callable, sizes, sync: Callable[[], None], repeats: int, min_call_s: float) -> float:
    """Work per second of the first size whose call takes `min_call_s` (or the largest)."""
    for size in sizes:
        fn, work = make(size)
        fn()  # warm-up: kernels chosen, allocator settled
        sync()
        t = _timed(fn, sync)
        if t >= min_call_s or size == sizes[-1]:
            best = min(_timed(fn, sync) for _ in range(repeats))
            return work / max(best, 1e-9)
    raise AssertionError("unreachable")


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


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
