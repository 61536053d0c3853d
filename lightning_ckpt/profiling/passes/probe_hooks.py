"""Hooks and counters for one measured training step (`profiler.probe_step` runs them).

Forward pre- and post-hooks on every block mark its window and read its boundary tensors, a
saved-tensor hook charges each saved storage to the first block that saves it, gradient hooks
on block outputs mark the backward windows, and a ledger of storage lives (`lifetimes`) lets
`account_carried` take what outlives its neighbour edge out of the per-block fields.

The window holds the whole block call, as a checkpointed region does (`apply.hook_order`): the
pre-hook runs before every other pre-hook of the block (it reads the input as the caller passed it,
and the other hooks' ops, a user's or a strategy's gather, are the block's) and the post-hook after
the forward hooks registered before it (the output as the caller receives it).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.structure.batch import first_tensor, tensors_in
from lightning_ckpt.profiling.structure.chain_check import receives_output, tensor_version
from lightning_ckpt.profiling.memory.lifetimes import PRE, Marks, StorageLedger, block_region, carried_terms, gap_region, held_rise, is_local
from lightning_ckpt.profiling.work.op_bytes import WorkTally
from lightning_ckpt.profiling.work.op_profile import OpProfileRecorder
from lightning_ckpt.profiling.passes.recompute_probe import RecomputedSaves, SavedBox
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker, storage_bytes, storage_key

__all__ = ["Probe"]


class Probe:
    """Hooks and counters for one measured step."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        tracker: LiveBytesTracker,
        flops: Any,
        names: Sequence[str],
        work: WorkTally | None = None,
        batch_keys: set | None = None,
        op_profile: OpProfileRecorder | None = None,
        params: list[torch.Tensor] | None = None,
    ):
        """`params`: `list(model.parameters())`, when the caller has it."""
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
        params = list(model.parameters()) if params is None else params
        self.param_keys = {storage_key(p) for p in params}
        # ZeRO-3 and FSDP2 parameters are empty or sharded until gathered: also tell them by identity.
        self.param_ids = {id(p) for p in params}
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
        self.stop_output = [0] * n  # `BlockCost.stop_output_bytes`
        self.last_pack_tick = [0] * n  # the ledger's tick when the block last saved an activation
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
        self.pre_own = 0
        self.post_peak = 0
        self.post_fwd_peak: int | None = None
        self.live_after_last = 0
        self.prev_output: Any = None
        self.last_output: Any = None
        self.prev_version: int | None = None
        self.bwd_open: int | None = None  # block whose backward window is open
        self.bwd_start_live = 0
        self.post_open = False
        self.post_end_tick: int | None = None  # where the head's window closed (the first block gradient)
        # storage lives (`lifetimes`): window ticks, the serials behind each block's fields
        self.ledger: StorageLedger = tracker.ledger
        self.entry_tick = [0] * n
        self.exit_tick = [0] * n
        self.grad_tick: list[int | None] = [None] * n
        self.grad_serial: dict[int, int] = {}
        # every storage a parameter's `.grad` was in the backward: a module called several times may have its
        # gradient replaced by the sum at a later call, and the first is a gradient too, not a carried tensor
        self.param_grads: set[int] = set()
        self.grad_written: dict[int, int | None] = {}  # id of a parameter -> the block whose backward wrote its .grad
        # each block's backward window as ledger ticks (t0, t1], and (serial, tick) of each gradient written in it
        self.bwd_window: list[tuple[int, int] | None] = [None] * n
        self.bwd_writes: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.owned: list[list] = [[] for _ in range(n)]  # (serial, bytes) of what each block saved first
        self.shared_serials: list[list] = [[] for _ in range(n)]
        self.input_serial: list[int | None] = [None] * n
        self.output_serial: list[int | None] = [None] * n
        self.input_unsaved = [0] * n
        self.gap_peak = [0] * n  # peak of the modules between block k - 1 and block k, above their start
        self.live_exit = [0] * n
        self.packed: list[weakref.ref] = []  # what the pass saved for backward (`release`)
        self.saves: RecomputedSaves | None = None  # set for a pass under checkpointing (`recompute_probe`)

    # forward
    def pre_hook(self, i, module, args, kwargs):
        if i != self.next_block:
            names = self.names
            expected = names[self.next_block] if self.next_block < self.n else "none (every block call was made)"
            raise ValueError(
                f"block call {names[i]!r} ran when {expected!r} was expected: this step calls the blocks in another "
                "order than the step the chain of calls was read from (each block call is one entry, in call order). "
                "A step must call the blocks in the same order every time; name blocks whose calls do not depend "
                "on the batch."
            )
        self.next_block = i + 1
        if i > 0:
            self.gap_peak[i] = max(0, self.tracker.peak_bytes - self.live_exit[i - 1])
        # the tensors of (args, kwargs) in order, walked once: the first argument's first, then the rest
        in_args, in_kwargs = list(tensors_in(args)), list(tensors_in(kwargs))
        first = (in_args[0] if in_args else None) if args else (in_kwargs[0] if in_kwargs else None)
        passed = [t for t in in_args + in_kwargs if t is not first]
        if first is not None:
            passed.insert(0, first)
        keys = [storage_key(t) for t in passed]
        self.ledger.passed(keys, i)
        if i > 0:
            # the previous output itself, or an alias of it (ZeRO-3 re-wraps it): see `receives_output`
            self.chains[i] = bool(args) and receives_output(args[0], self.prev_output, self.prev_version)
        # held no longer than the step holds it, its life measured: freed here, it died before this block
        self.prev_output = None
        self.ledger.region = block_region(i)
        self.entry_tick[i] = self.ledger.mark()
        self.current = i
        self.parameters_seen(module)
        self.input_key[i] = keys[0] if first is not None else None
        self.input_serial[i] = self.ledger.serial(self.input_key[i])
        in_batch = self.input_key[i] in self.batch_keys
        self.input_bytes[i] = storage_bytes(first) if first is not None and not in_batch else 0
        if i > 0 and self.input_key[i] is not None and self.owner.get(self.input_key[i]) == i - 1:
            self.input_by_prev[i] = self.input_bytes[i]
        self.live_entry[i] = self.tracker.live_bytes
        if i == 0:
            own = self.input_bytes[0] if self.tracker.is_live(self.input_key[0]) else 0
            self.pre_own = own
            self.pre_bytes = max(0, self.tracker.live_bytes - own)
        self.tracker.reset_peak()
        self.flops_at_entry[i] = self.flops.get_total_flops()
        self.flops_at_last_pack[i] = self.flops_at_entry[i]
        self.work_at_entry[i] = self.work_at_last_pack[i] = self._work()
        if self.op_profile is not None:
            self.op_profile.begin()
            self.work.on_op = self._record_op
        if self.saves is not None:
            self.saves.enter(i, module, args, kwargs)

    def _record_op(self, func, args, kwargs, outs, flops, mem, rng) -> None:
        """`op_profile.record`, given the storage keys `work` has for the op already."""
        inputs, out_keys = self.work.op_keys
        self.op_profile.record(func, args, kwargs, outs, flops, mem, rng, inputs, out_keys, self.work.op_traits)

    def parameters_seen(self, module, *args) -> None:
        """Know the block's parameters by identity. FSDP2 (like ZeRO-3) swaps in unsharded parameters
        in a pre-hook of its own, which runs after `pre_hook` (first of all) and before this one (last)."""
        self.param_ids.update(map(id, module.parameters()))

    def post_hook(self, i, module, args, output):
        out = first_tensor(output)
        self.prev_output = out if i + 1 < self.n else None
        if i + 1 == self.n:
            # [constraint] held through the backward on purpose: the last block's backward scratch is then
            # measured as a recompute sees it (a segment's rebuilt output stays alive through that block's
            # backward); `carried_terms` knows the hold is the probe's, not the step's
            self.last_output = out
        self.prev_version = tensor_version(out)
        live = self.tracker.live_bytes
        self.output_bytes[i] = storage_bytes(out) if out is not None else 0
        key = storage_key(out) if out is not None else None
        if out is not None and self.owner.get(key) == i:
            self.output_saved[i] = self.output_bytes[i]
        self.fwd_transient[i] = max(0, self.tracker.peak_bytes - live)
        serial = self.ledger.serial(key) if out is not None else None
        if serial is not None and self.ledger.born_in[serial] == block_region(i):
            # [constraint] made by the time the last saved tensor was saved: a recompute stopped there holds it
            if self.ledger.born_at[serial] <= self.last_pack_tick[i]:
                self.stop_output[i] = self.output_bytes[i] - self.output_saved[i]
        self.fwd_flops[i] = self.flops.get_total_flops() - self.flops_at_entry[i]
        self.fwd_work[i] = _minus(self._work(), self.work_at_entry[i])
        if self.op_profile is not None:
            self.work.on_op = None
            self.ops[i] = self.op_profile.end()
        self.current = None
        if out is not None and out.requires_grad:
            out.register_hook(self._bwd_marker(i))
        self.output_serial[i] = self.ledger.serial(key) if out is not None else None
        self.ledger.region = gap_region(i + 1)
        self.exit_tick[i] = self.ledger.mark()
        self.live_exit[i] = live
        self.tracker.reset_peak()  # the gap's window (`gap_peak`), or the head's
        if i == self.n - 1:
            self.live_after_last = live - (self.output_bytes[i] if self.tracker.is_live(key) else 0)
            self.post_open = True
            self.tracker.reset_peak()

    def pack(self, t: torch.Tensor):
        i = self.current
        key = storage_key(t)
        self.ledger.saved(key)
        if i is not None:
            base = t._base
            activation = (
                key is not None and key not in self.param_keys and key not in self.batch_keys
                and id(t if base is None else base) not in self.param_ids
            )
            if activation:
                first_owner = self.owner.get(key)
                if first_owner is None:
                    self.owner[key] = i
                    nbytes = storage_bytes(t)
                    self.saved[i] += nbytes
                    self.owned[i].append((self.ledger.serial(key), nbytes))
                    if key == self.input_key[i]:
                        self.input_saved[i] = nbytes
                elif first_owner == i - 1 and key not in self.shared_keys[i]:
                    # [constraint] saved by the previous block too: counted there, and
                    # here only when that block is checkpointed and this one kept.
                    self.shared_keys[i].add(key)
                    nbytes = storage_bytes(t)
                    self.shared_prev[i] += nbytes
                    self.shared_serials[i].append((self.ledger.serial(key), nbytes))
            self.flops_at_last_pack[i] = self.flops.get_total_flops()
            self.last_pack_tick[i] = self.ledger.mark()
            self.work_at_last_pack[i] = self.work.snapshot() if self.work is not None else (0, 0)
            if self.op_profile is not None:
                self.op_profile.packed(key if activation else None)
            if self.saves is not None:  # under checkpointing: a storage the block made is let go at its end
                s = self.ledger.serial(key) if activation else None
                box = self.saves.box(t, i, key, s is not None and self.ledger.born_in[s] == block_region(i))
                self.packed.append(weakref.ref(box))
                return box
        box = SavedBox(t, None, -1)
        self.packed.append(weakref.ref(box))  # weakly: the graph alone decides how long it lives
        return box

    def unpack(self, box: SavedBox) -> torch.Tensor:
        return box.tensor if self.saves is None else self.saves.unpack(box)

    def rename(self, key: Any, new_key: Any) -> None:
        """A storage let go under checkpointing died and is counted on under `new_key`: so is it here."""
        if key in self.owner:
            self.owner[new_key] = self.owner.pop(key)
        for keys in self.shared_keys:
            if key in keys:
                keys.discard(key)
                keys.add(new_key)

    def release(self) -> None:
        """Let go of every tensor the pass saved, and of the block outputs the probe holds. A pack hook that
        holds a tensor its own op made closes a loop through autograd's C++ graph (node -> saved variable ->
        tensor -> node), and a block output holds the probe through its gradient hook while the probe holds
        it: Python's garbage collector sees neither loop, and only a backward opens the first. A pass stopped
        before its backward (at the room's limit, or by an error) would leave its whole graph alive."""
        self.prev_output = self.last_output = None
        for ref in self.packed:
            saved = ref()
            if saved is not None:
                saved.tensor = None
        self.packed.clear()

    def _work(self) -> tuple[int, int]:
        return self.work.snapshot() if self.work is not None else (0, 0)

    def tail_work(self, i: int) -> tuple[int, int]:
        """(mem, rng) bytes written after block i's last saved tensor (early stop skips them)."""
        return _minus(self.fwd_work[i], _minus(self.work_at_last_pack[i], self.work_at_entry[i]))

    # backward
    def grad_accumulated(self, param: torch.Tensor) -> None:
        """A parameter's gradient was written (`Tensor.register_post_accumulate_grad_hook`)."""
        if self.saves is not None:  # (deaths the unplanned step has had by now are counted first)
            self.saves.look_for_deaths()
        serial = self.ledger.serial(storage_key(param.grad)) if param.grad is not None else None
        if serial is not None:
            self.param_grads.add(serial)
            if self.bwd_open is not None:  # where its block's backward stretches are cut (`backward_phases`)
                self.bwd_writes[self.bwd_open].append((serial, self.ledger.mark()))
        # a parameter used by several calls gets its .grad once all their contributions are in (autograd sums
        # them first): in the backward of the call that runs last, not of the first
        self.grad_written.setdefault(id(param), self.bwd_open)

    def _bwd_marker(self, i: int):
        def hook(grad):
            if self.saves is not None:
                self.saves.look_for_deaths()
            self._close_window()
            self.grad_tick[i] = self.ledger.mark()
            serial = self.ledger.serial(storage_key(grad))
            if serial is not None:
                self.grad_serial[i] = serial
            self.bwd_open = i
            self.bwd_start_live = self.tracker.live_bytes
            self.tracker.reset_peak()

        return hook

    def _close_window(self) -> None:
        if self.post_open:
            self.post_peak = max(0, self.tracker.peak_bytes - self.live_after_last)
            self.post_end_tick = self.ledger.mark()
            self.post_open = False
        if self.bwd_open is not None:
            self.bwd_transient[self.bwd_open] = max(0, self.tracker.peak_bytes - self.bwd_start_live)
            self.bwd_window[self.bwd_open] = (self.grad_tick[self.bwd_open], self.ledger.mark())
            self.bwd_open = None

    def account_carried(
        self, model: nn.Module, forward_end: int, backward_end: int, ckpt_peaks: list[int], outside: dict
    ):
        """[constraint] What outlives its neighbour edge (`lifetimes.is_local`) leaves the per-block
        fields and is counted in the windows it is alive in; a block after a gap that ran ops does
        not chain (inside a segment the gap would not be rebuilt). The gradient of a parameter
        outside the blocks (`outside`: storage key -> gradient bytes) is made by the backward of
        the region that read it last. -> (carried terms, gap bytes, late gradient bytes per block)."""
        led, n = self.ledger, self.n
        late = [0] * n
        for key, nbytes in outside.items():
            r = led.param_last.get(key)
            if r is None:
                continue  # never read (or not seen, as a sharded parameter): the head's, as before
            # read last before block k (in the gap before it, in block k - 1, or before the chain)
            k = (r + 1) // 2 if r % 2 else r // 2 + 1
            if k < n:
                late[k] += nbytes
        busy = {led.born_in[s] for s in range(len(led.nbytes)) if led.born_forward[s]}
        busy |= {r for regions in led.saved_in for r in regions}
        # a sharded block's parameters are gathered by the strategy's own pre-forward hook, which may run
        # before the probe's (one put in front after it): that is not a module between the blocks, and such
        # blocks chain as before
        gapped = [k for k in range(1, n) if gap_region(k) in busy and not _gathers_params(self.blocks[k])]
        for k in gapped:
            self.chains[k] = False
        grads = {led.serial(storage_key(p.grad)) for p in model.parameters() if p.grad is not None} - {None}
        grads |= self.param_grads
        marks = Marks(self.entry_tick, self.exit_tick, self.grad_tick, forward_end, backward_end)
        terms = carried_terms(led, marks, self.chains, grads, self.output_serial, self.grad_serial)
        self.last_output = None

        def carried(s) -> bool:
            if s is None:
                return False
            return s in terms.carried or (led.born_in[s] == PRE and not is_local(led, s, n))

        for i in range(n):
            self.saved[i] -= sum(b for s, b in self.owned[i] if carried(s))
            self.shared_prev[i] -= sum(b for s, b in self.shared_serials[i] if carried(s))
            if carried(self.input_serial[i]):
                self.input_bytes[i] = self.input_saved[i] = self.input_by_prev[i] = 0
                if i == 0:
                    self.pre_bytes += self.pre_own  # made before the chain: resident all step with the rest
            s = self.input_serial[i]
            if s is not None and not carried(s) and not led.saved_in[s] & {block_region(i), block_region(i - 1)}:
                self.input_unsaved[i] = self.input_bytes[i]
            if carried(self.output_serial[i]):
                self.output_bytes[i] = self.output_saved[i] = 0
            ckpt_peaks[i] = max(0, ckpt_peaks[i] - terms.born[i])
        gaps = [0] * n
        for k in gapped:
            gaps[k] = self.gap_peak[k] + self.output_bytes[k - 1] + terms.at_exit[k - 1]
        return terms, gaps, late

    def hold_in_head(self, carried: frozenset, forward_end: int) -> None:
        """[constraint] The model counts what was made before the chain as resident all step
        (`pre_saved_bytes`) and the carried storages alive when the last block ends as alive through
        the head (`carried_end_bytes`). A checkpointed block holds its arguments until its backward,
        so a block's argument the step without checkpointing frees in the head (the mask every block
        gets, an input no op saves) is still there under a plan: the head's peaks are taken with those
        alive. What no block gets dies in the head under every plan, as measured."""
        if not self.n or self.post_end_tick is None:
            return
        led, t0 = self.ledger, self.exit_tick[-1]
        held = {
            s for s in range(len(led.nbytes))
            if led.args[s] and (s in carried or (led.born_forward[s] and led.born_in[s] == PRE))
            and led.born_at[s] <= t0 and (led.died_at[s] is None or led.died_at[s] > t0)
        }
        if self.post_fwd_peak is not None:
            self.post_fwd_peak += held_rise(led, t0, forward_end, held)
        self.post_peak += held_rise(led, t0, self.post_end_tick, held)


def _minus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip(a, b))  # (mem, rng) bytes, and comm bytes from `ProbeCounters`


def _gathers_params(block: nn.Module) -> bool:
    """Whether a strategy gathers `block`'s parameters in a pre-forward hook of its own: FSDP2's
    `fully_shard` or DeepSpeed ZeRO-3 (its parameters carry `ds_id`)."""
    if type(block).__name__.startswith("FSDP") or hasattr(block, "_get_fsdp_state"):
        return True
    return any(hasattr(p, "ds_id") for p in block.parameters(recurse=True))
