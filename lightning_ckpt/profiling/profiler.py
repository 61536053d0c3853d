"""Measure a training step block by block, without changing any state.

One probe runs `step_fn(batch)` (forward and loss) and `loss.backward()` under a
live-bytes tracker, a FLOP counter and saved-tensor hooks, with hooks that mark
each block's forward and backward. It records per block what it saves for
backward, its boundary tensors, its scratch space, FLOPs, the bytes written by ops
that have no FLOPs (`op_bytes`), forward time and, per op call, the same split and
what keeping it would hold (`op_profile`). Parameters, buffers, gradients and
RNG state are restored after every probe. `profile_model` also measures the
machine's rates once (`rates`), so that counted work can be turned into time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt.planning.costs import BlockCost, StepCost
from lightning_ckpt.planning.linear_fit import Profile, refit_without_smallest
from lightning_ckpt.planning.machine_rates import MachineRates
from lightning_ckpt.profiling.batch import batch_size_of, first_tensor, slice_batch, tensors_in
from lightning_ckpt.profiling.chain_check import receives_output, tensor_version
from lightning_ckpt.profiling.op_bytes import OpBytesCounter
from lightning_ckpt.profiling.op_profile import OpProfileRecorder
from lightning_ckpt.profiling.state import preserved_state
from lightning_ckpt.profiling.tracker import (
    LiveBytesTracker,
    storage_bytes,
    storage_key,
    unique_storage_bytes,
)

StepFn = Callable[[Any], torch.Tensor]


# ----------------------------------------------------------------------------- one probe


class _Probe:
    """Hooks and counters for one measured step."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        tracker: LiveBytesTracker,
        flops: FlopCounterMode,
        names: Sequence[str],
        work: OpBytesCounter | None = None,
        batch_keys: set | None = None,
        op_profile: OpProfileRecorder | None = None,
    ):
        self.blocks = list(blocks)
        self.names = list(names)
        self.next_block = 0
        self.n = len(self.blocks)
        self.tracker = tracker
        self.flops = flops
        self.work = work
        # per op call of each block's forward, fed by `work` while the block runs
        self.op_profile = op_profile if work is not None else None
        self.ops: list[tuple] = [()] * len(self.blocks)
        self.param_keys = {storage_key(p) for p in model.parameters()}
        # ZeRO-3 and FSDP2 parameters are empty or sharded until gathered: also tell them by identity.
        self.param_ids = {id(p) for p in model.parameters()}
        # the batch is alive all step (`StepCost.batch_bytes`): never a block's saved or boundary bytes
        self.batch_keys = batch_keys or set()
        self.current: int | None = None
        self.done_blocks = 0
        self.owner: dict[Any, int] = {}
        n = self.n
        self.saved = [0] * n
        self.input_key: list[Any] = [None] * n
        self.input_bytes = [0] * n
        self.input_saved = [0] * n
        self.shared_prev = [0] * n
        self.shared_keys: list[set] = [set() for _ in range(n)]
        self.input_by_prev = [0] * n
        self.output_bytes = [0] * n
        self.output_saved = [0] * n
        self.fwd_transient = [0] * n
        self.bwd_transient = [0] * n
        self.fwd_flops = [0] * n
        self.flops_at_entry = [0] * n
        self.flops_at_last_pack = [0] * n
        # (mem_bytes, rng_bytes) written by 0-FLOP ops: at entry, in the forward, at the last pack
        self.work_at_entry = [(0, 0)] * n
        self.fwd_work = [(0, 0)] * n
        self.work_at_last_pack = [(0, 0)] * n
        self.chains = [True] * n
        self.live_entry = [0] * n
        self.pre_bytes = 0
        self.post_peak = 0
        self.post_fwd_peak: int | None = None
        self.live_after_last = 0
        self.prev_output: Any = None
        self.prev_version: int | None = None
        self.bwd_open: int | None = None  # block whose backward window is open
        self.bwd_start_live = 0
        self.post_open = False

    # forward
    def pre_hook(self, module, args, kwargs):
        i = self._index(module)
        if i != self.next_block:
            names = self.names
            raise ValueError(
                f"block {names[i]!r} ran when block {names[self.next_block] if self.next_block < self.n else 'none'!r} "
                "was expected: the blocks must be listed in the order the forward calls them, each once per step. "
                "Reorder blocks, or name a container whose children run in order."
            )
        self.next_block = i + 1
        first = first_tensor(args) if args else first_tensor(kwargs)
        if i > 0:
            # the previous output itself, or an alias of it (ZeRO-3 re-wraps it): see `receives_output`
            self.chains[i] = bool(args) and receives_output(args[0], self.prev_output, self.prev_version)
        self.current = i
        # FSDP2 (like ZeRO-3) swaps in unsharded parameters just before a block runs: know them by identity
        self.param_ids.update(id(p) for p in module.parameters())
        self.input_key[i] = storage_key(first) if first is not None else None
        in_batch = self.input_key[i] in self.batch_keys
        self.input_bytes[i] = storage_bytes(first) if first is not None and not in_batch else 0
        if i > 0 and self.input_key[i] is not None and self.owner.get(self.input_key[i]) == i - 1:
            self.input_by_prev[i] = self.input_bytes[i]
        self.live_entry[i] = self.tracker.live_bytes
        if i == 0:
            own = self.input_bytes[0] if self.tracker.is_live(self.input_key[0]) else 0
            self.pre_bytes = max(0, self.tracker.live_bytes - own)
        self.tracker.reset_peak()
        self.flops_at_entry[i] = self.flops.get_total_flops()
        self.flops_at_last_pack[i] = self.flops_at_entry[i]
        self.work_at_entry[i] = self.work_at_last_pack[i] = self._work()
        if self.op_profile is not None:
            self.op_profile.begin()
            self.work.on_op = self.op_profile.record

    def post_hook(self, module, args, output):
        i = self._index(module)
        out = first_tensor(output)
        self.prev_output = out
        self.prev_version = tensor_version(out)
        live = self.tracker.live_bytes
        self.output_bytes[i] = storage_bytes(out) if out is not None else 0
        if out is not None and self.owner.get(storage_key(out)) == i:
            self.output_saved[i] = self.output_bytes[i]
        self.fwd_transient[i] = max(0, self.tracker.peak_bytes - live)
        self.fwd_flops[i] = self.flops.get_total_flops() - self.flops_at_entry[i]
        self.fwd_work[i] = _minus(self._work(), self.work_at_entry[i])
        if self.op_profile is not None:
            self.work.on_op = None
            self.ops[i] = self.op_profile.end()
        self.current = None
        if out is not None and out.requires_grad:
            out.register_hook(self._bwd_marker(i))
        if i == self.n - 1:
            self.live_after_last = live - (self.output_bytes[i] if self.tracker.is_live(storage_key(out)) else 0)
            self.post_open = True
            self.tracker.reset_peak()

    def pack(self, t: torch.Tensor):
        i = self.current
        if i is not None:
            key = storage_key(t)
            base = t if t._base is None else t._base
            activation = (
                key is not None and key not in self.param_keys and key not in self.batch_keys
                and id(base) not in self.param_ids
            )
            if activation:
                first_owner = self.owner.get(key)
                if first_owner is None:
                    self.owner[key] = i
                    nbytes = storage_bytes(t)
                    self.saved[i] += nbytes
                    if key == self.input_key[i]:
                        self.input_saved[i] = nbytes
                elif first_owner == i - 1 and key not in self.shared_keys[i]:
                    # [constraint] saved by the previous block too: counted there, and
                    # here only when that block is checkpointed and this one kept.
                    self.shared_keys[i].add(key)
                    self.shared_prev[i] += storage_bytes(t)
            self.flops_at_last_pack[i] = self.flops.get_total_flops()
            self.work_at_last_pack[i] = self._work()
            if self.op_profile is not None:
                self.op_profile.packed(key if activation else None)
        return t

    @staticmethod
    def unpack(t):
        return t

    def _work(self) -> tuple[int, int]:
        return self.work.snapshot() if self.work is not None else (0, 0)

    def tail_work(self, i: int) -> tuple[int, int]:
        """(mem, rng) bytes written after block i's last saved tensor (early stop skips them)."""
        return _minus(self.fwd_work[i], _minus(self.work_at_last_pack[i], self.work_at_entry[i]))

    # backward
    def _bwd_marker(self, i: int):
        def hook(grad):
            self._close_window()
            self.bwd_open = i
            self.bwd_start_live = self.tracker.live_bytes
            self.tracker.reset_peak()

        return hook

    def _close_window(self) -> None:
        if self.post_open:
            self.post_peak = max(0, self.tracker.peak_bytes - self.live_after_last)
            self.post_open = False
        if self.bwd_open is not None:
            self.bwd_transient[self.bwd_open] = max(0, self.tracker.peak_bytes - self.bwd_start_live)
            self.bwd_open = None

    def _index(self, module) -> int:
        for k, b in enumerate(self.blocks):
            if b is module:
                return k
        raise AssertionError("hook on a module that is not a block")


def _minus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] - b[0], a[1] - b[1]


def _grad_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def probe_step(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: StepFn,
    batch: Any,
    names: Sequence[str] | None = None,
    timing: bool = True,
) -> StepCost:
    """Measure one forward+backward of `step_fn(batch)`; leaves all state as found."""
    blocks = list(blocks)
    names = list(names) if names is not None else [f"block{i}" for i in range(len(blocks))]
    batch_n = batch_size_of(batch)
    batch_tensors = list(tensors_in(batch))
    batch_keys = {storage_key(t) for t in batch_tensors} - {None}
    with preserved_state(model):
        tracker = LiveBytesTracker()
        flops = FlopCounterMode(display=False)
        work = OpBytesCounter(flops)
        probe = _Probe(model, blocks, tracker, flops, names, work, batch_keys, OpProfileRecorder())
        handles = []
        for b in blocks:
            handles.append(b.register_forward_pre_hook(probe.pre_hook, with_kwargs=True))
            handles.append(b.register_forward_hook(probe.post_hook, always_call=True))
        try:
            with flops, work, tracker:  # `work` above `flops`: it sees each op before flops decomposes it
                with torch.autograd.graph.saved_tensors_hooks(probe.pack, probe.unpack):
                    loss = _as_loss(step_fn(batch))
                if probe.post_open:  # the forward is over: the head's and the loss's peak so far
                    probe.post_fwd_peak = max(0, tracker.peak_bytes - probe.live_after_last)
                step_fwd_flops = flops.get_total_flops()
                loss.backward()
                probe._close_window()
                del loss
            if probe.next_block != probe.n:
                raise ValueError(
                    f"only {probe.next_block} of the {probe.n} blocks ran in the step (the first missing is "
                    f"{names[probe.next_block]!r}); every listed block must run once per training step."
                )
        finally:
            for h in handles:
                h.remove()
        fwd_ms = _time_blocks(model, blocks, step_fn, batch) if timing else [0.0] * len(blocks)
        ckpt_peaks = _nosave_forward_peaks(blocks, step_fn, batch)

    outside_grad = _grad_bytes(model) - sum(_grad_bytes(b) for b in blocks)
    costs = tuple(
        BlockCost(
            name=names[i],
            saved_bytes=probe.saved[i],
            input_bytes=probe.input_bytes[i],
            input_saved_bytes=probe.input_saved[i],
            shared_with_previous_bytes=probe.shared_prev[i],
            input_saved_by_previous_bytes=probe.input_by_prev[i],
            output_bytes=probe.output_bytes[i],
            output_saved_bytes=probe.output_saved[i],
            fwd_transient_bytes=probe.fwd_transient[i],
            ckpt_fwd_peak_bytes=ckpt_peaks[i],
            bwd_transient_bytes=probe.bwd_transient[i],
            grad_bytes=_grad_bytes(blocks[i]),
            fwd_flops=int(probe.fwd_flops[i]),
            tail_flops=int(probe.fwd_flops[i] - (probe.flops_at_last_pack[i] - probe.flops_at_entry[i])),
            fwd_mem_bytes=probe.fwd_work[i][0],
            tail_mem_bytes=probe.tail_work(i)[0],
            fwd_rng_bytes=probe.fwd_work[i][1],
            tail_rng_bytes=probe.tail_work(i)[1],
            fwd_ms=fwd_ms[i],
            chains_from_previous=probe.chains[i] if i > 0 else True,
            ops=probe.ops[i],
        )
        for i in range(len(blocks))
    )
    return StepCost(
        blocks=costs,
        batch_size=batch_n,
        outside_grad_bytes=max(0, outside_grad),
        pre_saved_bytes=probe.pre_bytes,
        batch_bytes=unique_storage_bytes(batch_tensors),
        post_saved_bytes=probe.post_peak,
        post_forward_bytes=probe.post_fwd_peak,
        meta={"step_fwd_flops": int(step_fwd_flops), "work": work.dominant()},
    )


def _as_loss(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.requires_grad:
        raise ValueError(
            f"the training step returned {type(out).__name__}, not a scalar loss tensor that requires grad; "
            "lightning-ckpt profiles forward and backward, so training_step must return the loss (or {'loss': loss})."
        )
    return out


def _nosave_forward_peaks(blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any) -> list[int]:
    """Per block, the peak bytes above those live at its entry during a forward that
    saves nothing for backward, as a block inside a checkpointed segment runs: each
    intermediate lives only until the next op has consumed it. Measured in a forward
    without grad under the live-bytes tracker."""
    peaks = [0] * len(blocks)
    entry = [0] * len(blocks)
    tracker = LiveBytesTracker()
    handles = []
    for i, b in enumerate(blocks):

        def pre(module, args, i=i):
            entry[i] = tracker.live_bytes
            tracker.reset_peak()

        def post(module, args, out, i=i):
            peaks[i] = max(0, tracker.peak_bytes - entry[i])

        handles.append(b.register_forward_pre_hook(pre))
        handles.append(b.register_forward_hook(post))
    try:
        with torch.no_grad(), tracker:
            step_fn(batch)
    finally:
        for h in handles:
            h.remove()
    return peaks


def _time_blocks(model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any) -> list[float]:
    """Forward wall time of each block (ms), measured in a plain forward without grad."""
    times = [0.0] * len(blocks)
    starts = [0.0] * len(blocks)
    handles = []
    for i, b in enumerate(blocks):

        def pre(module, args, i=i):
            starts[i] = time.perf_counter()

        def post(module, args, out, i=i):
            times[i] = (time.perf_counter() - starts[i]) * 1e3

        handles.append(b.register_forward_pre_hook(pre))
        handles.append(b.register_forward_hook(post))
    try:
        with torch.no_grad():
            step_fn(batch)
    finally:
        for h in handles:
            h.remove()
    return times


# ----------------------------------------------------------------------------- profile


def profile_model(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: StepFn,
    batch: Any,
    probe_batch_sizes: tuple[int, int] = (1, 2),
    check_batch_size: int | None = 4,
    names: Sequence[str] | None = None,
    timing: bool = True,
    rates: MachineRates | None = None,
    calibrate_keeps: bool = True,
) -> Profile:
    """Probe at two small slices of `batch` (and check on a third) -> `Profile`.

    With `timing`, blocks are timed and the machine's rates measured on the device
    and dtypes that did most of the probed work (`rates.measure_rates`, ~40 ms on a CPU);
    `rates` given are used as they are. Either way they land in `meta["rates"]` of
    every probe, which the `time` cost metric needs. With `timing` and `calibrate_keeps`, each
    distinct block with op calls to keep is also timed alone on the whole `batch`, keeping them
    and not (`keep_calibration`, a few block steps each): only op-level plans need it.
    """
    n = batch_size_of(batch)
    sizes = [s for s in (*probe_batch_sizes, check_batch_size) if s is not None]
    if any(s < 1 for s in sizes) or len(set(probe_batch_sizes)) != 2:
        raise ValueError(f"probe batch sizes must be two different positive integers, got {probe_batch_sizes}.")
    if max(sizes) > n:
        raise ValueError(
            f"the batch has {n} samples but profiling slices up to {max(sizes)}; pass a larger batch or "
            "smaller probe_batch_sizes / check_batch_size."
        )
    probes = tuple(probe_step(model, blocks, step_fn, slice_batch(batch, s), names, timing) for s in probe_batch_sizes)
    check = None
    if check_batch_size is not None and check_batch_size not in probe_batch_sizes:
        check = probe_step(model, blocks, step_fn, slice_batch(batch, check_batch_size), names, timing=False)
    if timing and calibrate_keeps:
        from lightning_ckpt.profiling.keep_calibration import calibrated_profile

        calibrated = calibrated_profile(Profile(probes, check), model, blocks, step_fn, batch)  # type: ignore[arg-type]
        probes, check = calibrated.probes, calibrated.check
    if rates is None and timing:
        from lightning_ckpt.profiling.rates import measure_rates

        rates = measure_rates(**probes[-1].meta["work"])
    if rates is not None:
        probes = tuple(_with_rates(p, rates) for p in probes)
        check = None if check is None else _with_rates(check, rates)
    return refit_without_smallest(Profile(probes=probes, check=check))  # type: ignore[arg-type]



def _with_rates(cost: StepCost, rates: MachineRates) -> StepCost:
    return dataclasses.replace(cost, meta={**cost.meta, "rates": rates.to_dict()})
