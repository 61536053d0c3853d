"""Measure one training step block by block, without changing any state (`probe_step`).

One probe runs `step_fn(batch)` (forward and loss) and `loss.backward()` under a
live-bytes tracker and FLOP and work counters (one dispatch mode, `probe_counters`) and
saved-tensor hooks, with hooks that mark
each block's forward and backward. It records per block what it saves for
backward, its boundary tensors, its scratch space, FLOPs, the bytes written by ops
that have no FLOPs (`op_bytes`), forward time and, per op call, the same split and
what keeping it would hold (`op_profile`). A ledger of every storage's life
(`lifetimes`) splits what stays between neighbouring blocks from what is carried
further (skips, what modules outside the chain save) and measures the modules
between blocks. Parameters, buffers, gradients and RNG state are restored after every probe. Under checkpointing
(`recompute_probe`) the same pass holds about what the `full` plan does. `measured_profile` makes a
profile of several such passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.costs.block_costs import BlockCost, StepCost, backward_phase_peaks
from lightning_ckpt.profiling.memory.backward_phases import backward_phases
from lightning_ckpt.profiling.structure.batch import batch_size_of, tensors_in
from lightning_ckpt.profiling.structure.block_calls import CallSites, distinct, hook_calls
from lightning_ckpt.profiling.forward_state.forward_hazards import PythonStateWatch
from lightning_ckpt.profiling.passes.forward_passes import nosave_forward_peaks as _nosave_forward_peaks
from lightning_ckpt.profiling.passes.forward_passes import time_blocks as _time_blocks
from lightning_ckpt.profiling.memory.lifetimes import StorageLedger
from lightning_ckpt.profiling.work.op_profile import OpProfileRecorder
from lightning_ckpt.profiling.passes.probe_counters import ProbeCounters
from lightning_ckpt.profiling.passes.probe_hooks import Probe
from lightning_ckpt.profiling.passes.recompute_probe import RecomputedSaves
from lightning_ckpt.profiling.forward_state.state import preserved_state
from lightning_ckpt.profiling.memory.tp_memory import grad_held_bytes, local_nbytes
from lightning_ckpt.profiling.work.tp_work import comm_bytes
from lightning_ckpt.profiling.forward_state.written_state import WrittenStateWatch
from lightning_ckpt.profiling.memory.tracker import storage_key, unique_storage_bytes

StepFn = Callable[[Any], torch.Tensor]


def _grad_bytes(module: nn.Module, held: dict[int, int]) -> int:
    """What the gradients of `module`'s trainable parameters hold (`held`: `grad_held_bytes` after a backward)."""
    return sum(_held_bytes(p, held) for p in module.parameters() if p.requires_grad)


def _held_bytes(p: torch.Tensor, held: dict[int, int]) -> int:
    found = held.get(id(p))
    return local_nbytes(p) if found is None else found


def _entry_grad_bytes(blocks: Sequence[nn.Module], held: dict[int, int], written: dict[int, int | None]) -> list[int]:
    """Per entry, the gradient bytes its backward makes. A module called several times: each parameter's
    gradient where the backward wrote it (`written`: autograd sums the calls' contributions first, and the
    sum lands in the backward of the call that runs last), else at its last call's backward (the first to run)."""
    out = [0] * len(blocks)
    calls: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        calls.setdefault(id(b), []).append(i)
    for b in {id(b): b for b in blocks}.values():
        at_last = calls[id(b)][-1]
        if len(calls[id(b)]) == 1:
            out[at_last] = _grad_bytes(b, held)
            continue
        for p in b.parameters():
            if p.requires_grad:
                at = written.get(id(p))
                out[at if at in calls[id(b)] else at_last] += _held_bytes(p, held)
    return out


def probe_step(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: StepFn,
    batch: Any,
    names: Sequence[str] | None = None,
    timing: bool = True,
    room_bytes: int | None = None,
    recompute: bool = False,
) -> StepCost:
    """Measure one forward+backward of `step_fn(batch)`; leaves all state as found. With `room_bytes`,
    the pass (the batch included) is stopped by `LiveBytesOverLimit` once it holds more
    (`profile_budget`); `meta["pass_bytes"]` is the most it held. With `recompute`, the pass holds no
    block's saved tensors past its forward and rebuilds them in the backward (`recompute_probe`): the
    same measurements, at about the memory of the `full` plan."""
    blocks = list(blocks)
    names = list(names) if names is not None else [f"block{i}" for i in range(len(blocks))]
    batch_n = batch_size_of(batch)
    batch_tensors = list(tensors_in(batch))
    batch_keys = {storage_key(t) for t in batch_tensors} - {None}
    inside = {id(p) for b in distinct(blocks) for p in b.parameters()}
    params = list(model.parameters())  # (the step changes no module's parameters before the hooks are set)
    outside_params = {  # trainable parameters outside the blocks: where the forward reads them last
        storage_key(p): p for p in params if p.requires_grad and id(p) not in inside
    }
    outside_params.pop(None, None)
    with preserved_state(model):
        tracker = flops = work = ProbeCounters(ledger=StorageLedger())  # live bytes, FLOPs and work: one mode
        batch_bytes = unique_storage_bytes(batch_tensors)
        tracker.limit_bytes = None if room_bytes is None else room_bytes - batch_bytes
        tracker.ledger.param_last = dict.fromkeys(outside_params)
        probe = Probe(model, blocks, tracker, flops, names, work, batch_keys, OpProfileRecorder(), params)
        watch, written = PythonStateWatch(len(blocks)), WrittenStateWatch(len(blocks))
        sites = CallSites(blocks, names=names)
        if recompute:
            probe.saves = RecomputedSaves(tracker, probe.rename, functools.partial(_run_again, sites))
        handles = _block_hooks(sites, probe, watch, written)
        handles += [p.register_post_accumulate_grad_hook(probe.grad_accumulated) for p in params if p.requires_grad]
        try:
            with tracker:
                with torch.autograd.graph.saved_tensors_hooks(probe.pack, probe.unpack):
                    loss = _as_loss(step_fn(batch))
                if probe.post_open:  # the forward is over: the head's and the loss's peak so far
                    probe.post_fwd_peak = max(0, tracker.peak_bytes - probe.live_after_last)
                step_fwd_flops = flops.get_total_flops()
                if probe.saves is not None:
                    probe.saves.look_for_deaths()
                tracker.ledger.forward = False
                forward_end = tracker.ledger.mark()
                loss.backward()
                probe._close_window()
                del loss
                backward_end = tracker.ledger.mark()
            if probe.next_block != probe.n:
                raise ValueError(
                    f"only {probe.next_block} of the {probe.n} block calls ran in the step (the first missing is "
                    f"{names[probe.next_block]!r}); every block call of the chain must run in every training step. "
                    "A model that skips layers at random in training (LayerDrop) is profiled with skipping off; "
                    "a block that runs only for some batches cannot be one: leave it out of blocks=[...]."
                )
        finally:
            probe.release()  # a pass stopped before its backward leaves no graph alive
            if probe.saves is not None:
                probe.saves.release()
            for h in handles:
                h.remove()
        held = grad_held_bytes(model.parameters())  # what each gradient the backward made holds
        outside = {key: _held_bytes(p, held) for key, p in outside_params.items()}
        for p in params:  # (read: the forwards below run without them, `preserved_state` puts back the step's)
            p.grad = None
        fwd_ms = _time_blocks(model, blocks, step_fn, batch) if timing else [0.0] * len(blocks)
        ckpt_peaks = _nosave_forward_peaks(blocks, step_fn, batch)
        pass_bytes = batch_bytes + tracker.max_held_bytes
        terms, gaps, late = probe.account_carried(model, forward_end, backward_end, ckpt_peaks, outside)
        probe.hold_in_head(terms.carried, forward_end)

    entry_grads = _entry_grad_bytes(blocks, held, probe.grad_written)
    phases = backward_phases(probe.ledger, probe.bwd_window, probe.bwd_writes)
    outside_grad = _grad_bytes(model, held) - sum(entry_grads)
    room = max(0, outside_grad)  # parameters shared by two blocks count twice in the blocks' sum
    for i, nbytes in enumerate(late):
        late[i] = min(nbytes, room)
        room -= late[i]
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
            stop_output_bytes=probe.stop_output[i],
            ckpt_fwd_peak_bytes=ckpt_peaks[i],
            bwd_transient_bytes=probe.bwd_transient[i],
            kept_grads_bwd_transient_bytes=min(backward_phase_peaks(phases[i])[1], probe.bwd_transient[i]) if phases[i] else None,
            bwd_phase_bytes=phases[i],
            grad_bytes=entry_grads[i],
            fwd_flops=int(probe.fwd_flops[i]),
            tail_flops=int(probe.fwd_flops[i] - (probe.flops_at_last_pack[i] - probe.flops_at_entry[i])),
            fwd_mem_bytes=probe.fwd_work[i][0],
            tail_mem_bytes=probe.tail_work(i)[0],
            fwd_rng_bytes=probe.fwd_work[i][1],
            tail_rng_bytes=probe.tail_work(i)[1],
            fwd_comm_bytes=comm_bytes(probe.fwd_work[i]),
            tail_comm_bytes=comm_bytes(probe.tail_work(i)),
            fwd_ms=fwd_ms[i],
            chains_from_previous=probe.chains[i] if i > 0 else True,
            ops=probe.ops[i],
            carried_fwd_bytes=terms.fwd[i],
            carried_bwd_bytes=terms.bwd[i],
            gap_fwd_bytes=gaps[i],
            gap_grad_bytes=late[i],
            input_unsaved_bytes=probe.input_unsaved[i],
            unreplayable=tuple(sorted(watch.reasons[i])),
            written_state_bytes=written.bytes[i],
        )
        for i in range(len(blocks))
    )
    return StepCost(
        blocks=costs,
        batch_size=batch_n,
        outside_grad_bytes=max(0, outside_grad),
        pre_saved_bytes=probe.pre_bytes,
        batch_bytes=batch_bytes,
        post_saved_bytes=probe.post_peak,
        post_forward_bytes=probe.post_fwd_peak,
        carried_end_bytes=terms.end,
        meta={"step_fwd_flops": int(step_fwd_flops), "work": work.dominant(), "pass_bytes": pass_bytes,
              **({"under_checkpointing": True} if recompute else {})},
    )


def _run_again(sites: CallSites, i: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Call block `i` again as its forward did (the entry told to the hooks, which stay quiet)."""
    sites.cursor = i
    module(*args, **kwargs)


def _block_hooks(sites: CallSites, probe: Probe, watch: PythonStateWatch, written: WrittenStateWatch) -> list:
    """The probe's hooks on every block, with those that record the Python state (`PythonStateWatch`) and the
    module state (`WrittenStateWatch`) each block call writes, in this order around the block's own hooks:
    the probe's window first and last of all (it holds the whole block call, as an applied plan's region
    does: `probe_hooks`), the module state inside it (a hook of the block's own that writes state counts
    too), the Python state and the block's parameters (`Probe.parameters_seen`) after the block's own
    pre-hooks. One call counts the block's calls for all of them."""

    saves = probe.saves

    def pre(i, module, args, kwargs):
        if saves is not None:
            if saves.recomputing:
                return
            saves.look_for_deaths()
        probe.pre_hook(i, module, args, kwargs)
        written.before(i, module)

    def pre_last(i, module):
        if saves is not None and saves.recomputing:
            return
        if i is not None:
            watch.before(i, module)
        probe.parameters_seen(module)

    def post(i, module, args, output):
        if saves is not None:
            if saves.recomputing:
                return
            saves.look_for_deaths()
        watch.after(i)
        written.after(i)
        probe.post_hook(i, module, args, output)
        if saves is not None:
            saves.leave(i, replayable=not watch.reasons[i])

    return hook_calls(sites, pre, post, with_kwargs=True, prepend=True, strict=True, pre_last=pre_last)


def _as_loss(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.requires_grad:
        raise ValueError(
            f"the training step returned {type(out).__name__}, not a scalar loss tensor that requires grad; "
            "lightning-ckpt profiles forward and backward, so training_step must return the loss (or {'loss': loss})."
        )
    return out
