"""Measure a training step block by block, without changing any state.

One probe runs `step_fn(batch)` (forward and loss) and `loss.backward()` under a
live-bytes tracker and FLOP and work counters (one dispatch mode, `probe_counters`) and
saved-tensor hooks, with hooks that mark
each block's forward and backward. It records per block what it saves for
backward, its boundary tensors, its scratch space, FLOPs, the bytes written by ops
that have no FLOPs (`op_bytes`), forward time and, per op call, the same split and
what keeping it would hold (`op_profile`). A ledger of every storage's life
(`lifetimes`) splits what stays between neighbouring blocks from what is carried
further (skips, what modules outside the chain save) and measures the modules
between blocks. Parameters, buffers, gradients and RNG state are restored after every probe. `measure_profile` also measures the
machine's rates once (`rates`), so that counted work can be turned into time. Given a memory
budget, it holds every probe to it (`profile_budget`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.costs.block_costs import BlockCost, StepCost, backward_phase_peaks
from lightning_ckpt.costs.linear_fit import Profile, refit_without_smallest
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.profiling.applied_marks import refuse_marked
from lightning_ckpt.profiling.backward_phases import backward_phases
from lightning_ckpt.profiling.batch import batch_size_of, slice_batch, tensors_in
from lightning_ckpt.profiling.block_calls import CallSites, distinct, hook_calls
from lightning_ckpt.profiling.forward_hazards import PythonStateWatch
from lightning_ckpt.profiling.forward_passes import nosave_forward_peaks as _nosave_forward_peaks
from lightning_ckpt.profiling.forward_passes import time_blocks as _time_blocks
from lightning_ckpt.profiling.gather import sharded_world_size
from lightning_ckpt.profiling.lifetimes import StorageLedger
from lightning_ckpt.profiling.op_profile import OpProfileRecorder
from lightning_ckpt.profiling.probe_counters import ProbeCounters
from lightning_ckpt.profiling.probe_hooks import Probe
from lightning_ckpt.profiling.profile_budget import NoRoom, ProfileBudget, SliceRoom, check_within, optional_pass, probe_within
from lightning_ckpt.profiling.profile_budget import AT_LIMIT, SampleTooLong, released, smaller_probes
from lightning_ckpt.profiling.state import preserved_state
from lightning_ckpt.profiling.tp_memory import grad_held_bytes, local_nbytes
from lightning_ckpt.profiling.tp_work import comm_bytes
from lightning_ckpt.profiling.written_state import WrittenStateWatch
from lightning_ckpt.profiling.tracker import storage_key, unique_storage_bytes

StepFn = Callable[[Any], torch.Tensor]
MAX_REFITS = 2  # how often profiling leaves its smallest slice out and checks on one twice as large


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
) -> StepCost:
    """Measure one forward+backward of `step_fn(batch)`; leaves all state as found. With `room_bytes`,
    the pass (the batch included) is stopped by `LiveBytesOverLimit` once it holds more
    (`profile_budget`); `meta["pass_bytes"]` is the most it held."""
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
        handles = _block_hooks(blocks, names, probe, watch, written)
        handles += [p.register_post_accumulate_grad_hook(probe.grad_accumulated) for p in params if p.requires_grad]
        try:
            with tracker:
                with torch.autograd.graph.saved_tensors_hooks(probe.pack, probe.unpack):
                    loss = _as_loss(step_fn(batch))
                if probe.post_open:  # the forward is over: the head's and the loss's peak so far
                    probe.post_fwd_peak = max(0, tracker.peak_bytes - probe.live_after_last)
                step_fwd_flops = flops.get_total_flops()
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
            for h in handles:
                h.remove()
        held = grad_held_bytes(model.parameters())  # what each gradient the backward made holds
        outside = {key: _held_bytes(p, held) for key, p in outside_params.items()}
        fwd_ms = _time_blocks(model, blocks, step_fn, batch) if timing else [0.0] * len(blocks)
        ckpt_peaks = _nosave_forward_peaks(blocks, step_fn, batch)
        pass_bytes = batch_bytes + tracker.max_live_bytes
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
        meta={"step_fwd_flops": int(step_fwd_flops), "work": work.dominant(), "pass_bytes": pass_bytes},
    )


def _block_hooks(
    blocks: Sequence[nn.Module], names: Sequence[str], probe: Probe, watch: PythonStateWatch, written: WrittenStateWatch
) -> list:
    """The probe's hooks on every block, with those that record the Python state (`PythonStateWatch`) and the
    module state (`WrittenStateWatch`) each block call writes, in this order around the block's own hooks:
    the probe's window first and last of all (it holds the whole block call, as an applied plan's region
    does: `probe_hooks`), the module state inside it (a hook of the block's own that writes state counts
    too), the Python state and the block's parameters (`Probe.parameters_seen`) after the block's own
    pre-hooks. One call counts the block's calls for all of them."""

    def pre(i, module, args, kwargs):
        probe.pre_hook(i, module, args, kwargs)
        written.before(i, module)

    def pre_last(i, module):
        if i is not None:
            watch.before(i, module)
        probe.parameters_seen(module)

    def post(i, module, args, output):
        watch.after(i)
        written.after(i)
        probe.post_hook(i, module, args, output)

    sites = CallSites(blocks, names=names)
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


# ----------------------------------------------------------------------------- profile


def measure_profile(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    step_fn: StepFn,
    batch: Any,
    probe_batch_sizes: tuple[int, int] = (1, 2),
    check_batch_size: int | None = 4,
    names: Sequence[str] | None = None,
    timing: bool = True,
    rates: MachineRates | None = None,
    time_blocks: bool = True,
    budget: ProfileBudget | None = None,
) -> Profile:
    """Probe at two small slices of `batch` (and check on a third) -> `Profile`.

    With `budget`, every pass fits it (`profile_budget`): a check or refit slice predicted not to
    fit is shrunk to the largest that is, or left out (one line says so); a pass that reaches the
    room left to it, or runs out of CUDA memory, is stopped, the state put back, and the profile goes
    on without it (smaller probes when it was a probe, with a warning). When even the smallest probes
    do not fit, they are profiled over the budget with a warning that says what they held, and a
    device out of memory there is a `ProfileBudgetError`.

    When the line through the two probes misses the check slice, the smallest probe is left out
    (`linear_fit.refit_without_smallest`): the probe and the check define the line, and a slice of
    twice the check size checks it when the batch is that large (`Profile.fit_note` says so).
    Blocks sharded over several ranks (ZeRO-3, FSDP2) get no such larger slice: every rank runs
    the same passes, whatever its own bytes say.

    With `timing`, blocks are timed (unless `time_blocks` is False: only the `ms` cost metric and
    the plan table's measured forward time read them; 0.2 s of a profile on the encoder example)
    and the machine's rates measured on the device
    and dtypes that did most of the probed work (`rates.measure_rates`, 0.3-1.3 s on one CPU thread,
    kept for later runs: `rates.kept_rates`);
    `rates` given are used as they are. Either way they land in `meta["rates"]` of
    every probe, which the `time` cost metric needs. What keeping op outputs saves is measured
    later, by applying (`engine.step_profile.profile_model` calls `apply.keep_calibration`).
    """
    refuse_marked(blocks, names, "profile the blocks")  # they would measure the plan, not themselves
    n = batch_size_of(batch)
    sizes = [s for s in (*probe_batch_sizes, check_batch_size) if s is not None]
    if any(s < 1 for s in sizes) or len(set(probe_batch_sizes)) != 2:
        raise ValueError(f"probe batch sizes must be two different positive integers, got {probe_batch_sizes}.")
    fixed = sharded_world_size(blocks) > 1
    room = None if budget is None or fixed else budget.room_for(model, batch)
    if n == 1:  # one sample: one pass on the whole batch; lengths are the engine's (`engine.length_profiles`)
        return _one_sample_profile(model, blocks, step_fn, batch, names, timing and time_blocks, timing, rates, room)
    if max(sizes) > n:
        raise ValueError(
            f"the batch has {n} samples but profiling slices up to {max(sizes)}; pass a larger batch or "
            "smaller probe_batch_sizes / check_batch_size."
        )
    # Sharded blocks gather their parameters in every forward: ranks profiling together must run the
    # same passes, and their bytes may differ a little (uneven shards, buffers the communication
    # thread frees when it gets to it), so no pass here may depend on them: the check is timed with
    # the probes and no larger check is added.
    timed = timing and time_blocks
    # sharded blocks: no rank's bytes may decide which passes run (see above), so no budget decides them
    probes, probe_batch_sizes, check_batch_size = _first_probes(
        model, blocks, step_fn, batch, tuple(probe_batch_sizes), check_batch_size, names, timed, room
    )
    check = None
    if check_batch_size is not None and check_batch_size not in probe_batch_sizes:
        size = check_within(room, max(probe_batch_sizes), check_batch_size)
        check = optional_pass(room, size, "check slice", _pass(model, blocks, step_fn, batch, size, names, timed and fixed))
    fitted = refit_without_smallest(Profile(probes=probes, check=check))  # type: ignore[arg-type]
    size = None if check is None else check.batch_size
    for _ in range(0 if fixed else MAX_REFITS):
        if fitted.probes[0] is probes[0] or fitted.check is not None:
            break
        # [constraint] the smallest slice is off the line: the two larger ones define it, and a slice
        # twice the check, when the batch has one, checks it again (`Profile.fit_note` says so); with a
        # budget, the largest slice up to that which fits it
        probes, check = fitted.probes, None
        if 2 * size > n:
            break
        size = 2 * size if room is None else room.largest_fitting(size, 2 * size)
        check = optional_pass(room, size, "refit check slice", _pass(model, blocks, step_fn, batch, size, names, False))
        if check is None:
            break
        fitted = refit_without_smallest(Profile(probes=probes, check=check))  # type: ignore[arg-type]
    probes, check = fitted.probes, fitted.check
    if timed and not fixed:  # check slices promoted by the refit were profiled untimed: timed now
        probes = tuple(p if p.batch_size in probe_batch_sizes else _timed(model, blocks, step_fn, batch, p) for p in probes)
    if rates is None and timing:
        from lightning_ckpt.profiling.rates import kept_rates

        rates = kept_rates(**probes[-1].meta["work"], max_bytes=None if room is None else room.usable_bytes)
    if rates is not None:
        probes = tuple(_with_rates(p, rates) for p in probes)
        check = None if check is None else _with_rates(check, rates)
    return Profile(probes=probes, check=check)  # type: ignore[arg-type]



# torch's words when a BatchNorm in training gets one value per channel: (1, C) features, (1, C, 1, 1) maps
BATCHNORM_ONE_SAMPLE = "Expected more than 1 value per channel when training"


def _first_probes(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, sizes: tuple[int, int],
    check: int | None, names: Sequence[str] | None, timed: bool, room: SliceRoom | None = None, least: int = 1,
) -> tuple[tuple[StepCost, StepCost], tuple[int, int], int | None]:
    """The probes at `sizes` -> (probes, sizes, check). When the smallest is one sample and a BatchNorm
    refuses it (pooled (batch, channels) features have one value per channel), the sizes and the check
    are doubled, (1, 2) and 4 becoming (2, 4) and 8, with a warning that says so; a batch too small
    for that is refused with the sizes to set. With `room`, a probe stopped at its limit or out of CUDA
    memory gives way to probes half as large (at least `least`), with a warning; when they cannot be
    smaller, they run over the budget, with a warning that says what they held (out of device memory
    there: `ProfileBudgetError`)."""
    try:
        probes = tuple(probe_within(room, s, _pass(model, blocks, step_fn, batch, s, names, timed)) for s in sizes)
    except NoRoom as short:
        released()
        assert room is not None
        smaller = smaller_probes(sizes, least)
        if smaller is None and short.reason != AT_LIMIT:  # the device itself is out of memory
            raise room.refusal(short.size, short.reason) from None
        if smaller is None:  # nothing smaller fits: profiled over the budget, and said so
            over = dataclasses.replace(room, bounded=False)
            found = _first_probes(model, blocks, step_fn, batch, sizes, check, names, timed, over, least)
            if room.room_bytes > 0:  # (below what stays resident: planning says that nothing fits)
                warnings.warn(room.over_budget(short.size, found[1]), stacklevel=3)
            return found
        warnings.warn(
            f"lightning-ckpt: profiling on {short.size} samples was stopped ({short.reason}); the step is profiled "
            f"at probe_batch_sizes={smaller} instead of {sizes}.",
            stacklevel=3,
        )
        return _first_probes(model, blocks, step_fn, batch, smaller, check, names, timed, room, least)
    except ValueError as err:
        if 1 not in sizes or BATCHNORM_ONE_SAMPLE not in str(err):
            raise
        n, shifted = batch_size_of(batch), (2, 2 * max(sizes))
        if shifted[1] > n:
            fix = f"probe_batch_sizes=(2, {n})" if n > 2 else "a batch of at least 3 samples and probe_batch_sizes=(2, 3)"
            raise ValueError(
                f"the probe of 1 sample failed in a BatchNorm ({err}): in training a BatchNorm over (batch, channels) "
                f"features needs at least 2 samples, and the batch has {n}, too few for probes {shifted}. "
                f"Set {fix}."
            ) from err
        check = None if check is None or 2 * check > n else 2 * check
        warnings.warn(
            f"lightning-ckpt: a BatchNorm refuses a slice of 1 sample in training ({BATCHNORM_ONE_SAMPLE}), so "
            f"the step is profiled at probe_batch_sizes={shifted} instead of {sizes} and check_batch_size={check}; "
            f"set probe_batch_sizes={shifted} to start there.",
            stacklevel=3,
        )
        return _first_probes(model, blocks, step_fn, batch, shifted, check, names, timed, room, least=2)
    return probes, sizes, check  # type: ignore[return-value]


def _one_sample_profile(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, names: Sequence[str] | None,
    timed: bool, timing: bool, rates: MachineRates | None, room: SliceRoom | None,
) -> Profile:
    """The profile of a batch of one sample: one pass on it, within `room` (else `SampleTooLong`, the state
    put back), as a profile at batch size 1 only (`Profile.one_size`)."""
    try:
        probe = probe_within(room, 1, _pass(model, blocks, step_fn, batch, 1, names, timed))
    except NoRoom as short:
        released()
        raise SampleTooLong(short.reason) from None
    if rates is None and timing:
        from lightning_ckpt.profiling.rates import kept_rates

        rates = kept_rates(**probe.meta["work"], max_bytes=None if room is None else room.usable_bytes)
    if rates is not None:
        probe = _with_rates(probe, rates)
    return Profile(probes=(probe, probe), check=None)


def _pass(
    model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, size: int | None,
    names: Sequence[str] | None, timing: bool,
) -> Callable[[int | None], StepCost]:
    """`probe_step` on the first `size` samples of `batch`, given the room it may hold (`profile_budget`)."""
    return lambda room_bytes: probe_step(model, blocks, step_fn, slice_batch(batch, size), names, timing, room_bytes)


def _timed(model: nn.Module, blocks: Sequence[nn.Module], step_fn: StepFn, batch: Any, probe: StepCost) -> StepCost:
    """`probe` (profiled untimed, as a check slice is) with its blocks' forward times measured."""
    with preserved_state(model):
        fwd_ms = _time_blocks(model, blocks, step_fn, slice_batch(batch, probe.batch_size))
    return dataclasses.replace(probe, blocks=tuple(dataclasses.replace(b, fwd_ms=t) for b, t in zip(probe.blocks, fwd_ms)))


def _with_rates(cost: StepCost, rates: MachineRates) -> StepCost:
    return dataclasses.replace(cost, meta={**cost.meta, "rates": rates.to_dict()})
