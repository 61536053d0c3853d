"""Storage lifetimes over one probed step, and the bytes that outlive their neighbour edge.

The live-bytes tracker reports every storage an op makes and frees to a `StorageLedger`, which
stamps each with the *region* of the forward it was made in (before the chain, block i, the
modules outside the chain between two blocks, after the chain) and records where it was read,
saved for backward and passed to a block. A storage is *local* when its whole life stays
between its block (or gap) and the next block: the per-block fields of `BlockCost` describe
it. Every other storage is *carried* (a U-Net skip, the encoder output each decoder block
reads, what modules between two blocks save, a block's output kept in a Python list): its
bytes leave the per-block fields and are counted, from its measured life, in every phase it
is alive (`CarriedTerms`). Plain Python over integers; the probe owns torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CarriedTerms", "StorageLedger", "block_region", "carried_terms", "gap_region", "held_rise"]

PRE = -1  # the region before block 0; block i is region 2i, the gap before block k is 2k - 1


def block_region(i: int) -> int:
    return 2 * i


def gap_region(k: int) -> int:
    """The region of the modules outside the chain that run before block k (k = n: after the chain)."""
    return 2 * k - 1


class StorageLedger:
    """Every storage made while the tracker runs: size, birth and death ticks, the region it
    was made in, and the forward regions that read, saved or passed it (`tracker.LiveBytesTracker`
    calls `born`, `freed`, `used`; the probe sets `region`, calls `saved`, `passed`, `mark`)."""

    def __init__(self) -> None:
        self.tick = 0
        self.region = PRE
        self.forward = True
        self.nbytes: list[int] = []
        self.born_at: list[int] = []
        self.died_at: list[int | None] = []
        self.born_in: list[int] = []
        self.born_forward: list[bool] = []
        self.died_in: list[int | None] = []  # forward region of the death (None: freed in the backward or never)
        self.used_in: list[set] = []
        self.saved_in: list[set] = []
        self.args: list[list[tuple[int, bool]]] = []  # (block, first argument)
        self.param_last: dict = {}  # storage key of a watched parameter -> the last forward region that read it
        self._serial: dict = {}

    # -- from the tracker
    def born(self, key, nbytes: int) -> None:
        self.tick += 1
        self._serial[key] = len(self.nbytes)
        self.nbytes.append(int(nbytes))
        self.born_at.append(self.tick)
        self.died_at.append(None)
        self.born_in.append(self.region)
        self.born_forward.append(self.forward)
        self.died_in.append(None)
        self.used_in.append(set())
        self.saved_in.append(set())
        self.args.append([])

    def freed(self, key) -> None:
        s = self._serial.pop(key, None)
        if s is None:
            return
        self.tick += 1
        self.died_at[s] = self.tick
        if self.forward:
            self.died_in[s] = self.region

    def rename(self, key, new_key) -> None:
        """The storage at `key` goes on under `new_key` (`tracker.LiveBytesTracker.rename`)."""
        s = self._serial.pop(key, None)
        if s is not None:
            self._serial[new_key] = s

    def used(self, keys) -> None:
        if not self.forward:
            return
        for key in keys:
            if key in self.param_last:
                self.param_last[key] = self.region
            s = self._serial.get(key)
            if s is not None:
                self.used_in[s].add(self.region)

    # -- from the probe
    def serial(self, key) -> int | None:
        """The storage now at `key` (a `tracker.storage_key`), or None when the tracker did not make it."""
        return self._serial.get(key)

    def saved(self, key) -> None:
        s = self._serial.get(key)
        if s is not None and self.forward:
            self.saved_in[s].add(self.region)

    def passed(self, keys, block: int) -> None:
        """The storages behind a block's arguments, the first one first."""
        for j, key in enumerate(keys):
            s = self._serial.get(key)
            if s is not None:
                self.args[s].append((block, j == 0))

    def mark(self) -> int:
        return self.tick


def held_rise(ledger: StorageLedger, t0: int, t1: int, held: set) -> int:
    """How much higher the peak of live bytes over ticks (t0, t1] is when the storages `held`
    (serials) stay alive to t1 than it was as measured (each tick is one birth or one death)."""
    events = []
    for s in range(len(ledger.nbytes)):
        if t0 < ledger.born_at[s] <= t1:
            events.append((ledger.born_at[s], ledger.nbytes[s], True))
        died = ledger.died_at[s]
        if died is not None and t0 < died <= t1:
            events.append((died, -ledger.nbytes[s], s not in held))
    live = kept = peak = kept_peak = 0
    for _, delta, counts in sorted(events):
        live += delta
        kept += delta if counts else 0
        peak, kept_peak = max(peak, live), max(kept_peak, kept)
    return kept_peak - peak


@dataclass(frozen=True)
class Marks:
    """Ticks of the probed step's windows: entry and exit of each block's forward, the
    gradient of each block's output (None when it has none), the end of the forward and
    of the backward."""

    entry: list[int]
    exit: list[int]
    grad: list[int | None]
    forward_end: int
    backward_end: int


@dataclass(frozen=True)
class CarriedTerms:
    """Per block (lists of n) and for the head: what carried storages add, in bytes."""

    carried: frozenset  # serials of the carried storages
    fwd: list[int]  # alive at some moment of the block's forward
    bwd: list[int]  # alive during its backward window, plus carried gradients alive when it starts and what the head made that is alive then
    at_exit: list[int]  # alive when the block's forward ends
    born: list[int]  # made in the block and alive when it ends
    end: int  # alive when the last block's forward ends (the head and the loss run on top)


def is_local(ledger: StorageLedger, s: int, n: int, held: int | None = None) -> bool:
    """[constraint] A storage made in block i stays within block i, the gap after it and block
    i + 1 (the head, for the last block): read, saved or passed there, reaching block i + 1 only as
    its first argument, and freed before block i + 2 starts (a loop that rebinds `x = block(x)`
    frees it just after block i + 1). One made in a gap stays within it and the next block in the
    same way, and the gap saves none of it: whatever a gap saves lives to the gap's backward.
    `held`: the last block's output, which the probe itself holds to the end of the backward."""
    r = ledger.born_in[s]
    last = r + 2 if r % 2 == 0 else r + 1  # the next block's region
    allowed = set(range(r, last + 1))
    if ledger.used_in[s] - allowed:
        return False
    for where in ledger.saved_in[s]:
        if where not in allowed or (where % 2 == 1 and where != gap_region(n)):
            return False
    for block, first in ledger.args[s]:
        if not first or block_region(block) != last:
            return False
    died = ledger.died_in[s]
    if last < block_region(n) and not ledger.args[s] and not ledger.saved_in[s] and (died is None or died >= last):
        # alive beside the next block's forward without being its input or saved: no field of either
        # block holds it there (a module that keeps the previous block's output in a local while its
        # next block runs on a copy, as diffusers' Transformer2DModel does before `proj_out`)
        return False
    if died is not None:
        return died <= last + 1
    # alive after the forward with nothing saving it: a Python reference holds it (or the probe)
    return bool(ledger.saved_in[s]) or s == held


def carried_terms(
    ledger: StorageLedger, marks: Marks, chains: list[bool], param_grads: set, outputs: list, output_grads: dict
) -> CarriedTerms:
    """Classify the storages made in blocks and gaps (`is_local`) and sum the carried ones per window
    (those made before the chain stay in `pre_saved_bytes`, those made after it in the head's terms).

    `chains[k]`: block k chains from block k - 1. `param_grads`: serials of parameter gradients,
    which the memory model counts itself; `outputs[k]`, `output_grads[k]`: the serials of block k's
    output and of its gradient (the model counts that gradient as `output_bytes` when the output is
    local). Every other storage the backward made before block k's backward starts and that is
    still alive then (the gradient of a carried storage, waiting for its producer's backward) is in
    block k's backward term, and so is what the forward made after the chain and something holds
    during block k's backward window (the loss, which the caller holds while it backpropagates).

    [constraint] A carried storage lives as measured; one passed to block j lives at least until
    the backward of the earliest block a segment holding j can start at (a checkpointed segment
    holds its blocks' arguments until its backward is done).
    """
    n = len(marks.entry)
    first_start = [0] * n  # blocks first_start[j]..j all chain
    for j in range(1, n):
        first_start[j] = first_start[j - 1] if chains[j] else j
    # backward window of block k: from its output's gradient to the next gradient marker
    order = sorted((t, k) for k, t in enumerate(marks.grad) if t is not None)
    window_start = [0] * n
    window_end = [0] * n
    for idx, (t, k) in enumerate(order):
        window_start[k] = t
        window_end[k] = order[idx + 1][0] if idx + 1 < len(order) else marks.backward_end
    for k in range(n - 1, -1, -1):  # no marker: its backward runs in the window open before it
        if marks.grad[k] is None:
            if k + 1 < n:
                window_start[k], window_end[k] = window_start[k + 1], window_end[k + 1]
            else:
                window_start[k], window_end[k] = marks.forward_end, order[0][0] if order else marks.backward_end
    carried = set()
    death: dict[int, float] = {}
    for s in range(len(ledger.nbytes)):
        r = ledger.born_in[s]
        if not ledger.born_forward[s] or not 0 <= r < gap_region(n) or not ledger.nbytes[s]:
            continue
        if is_local(ledger, s, n, outputs[-1] if n else None):
            continue
        carried.add(s)
        died = ledger.died_at[s]
        d = float("inf") if died is None else died
        for block, _ in ledger.args[s]:
            d = max(d, window_end[first_start[block]])
        death[s] = d

    def alive(t0: int, t1: int) -> int:  # at some moment of (t0, t1]
        return sum(ledger.nbytes[s] for s in carried if ledger.born_at[s] <= t1 and death[s] > t0)

    def alive_at(t: int) -> int:
        return alive(t, t)

    # the gradient of a local output is the model's `output_bytes`
    own_grad = {k: g for k, g in output_grads.items() if outputs[k] not in carried}
    fwd = [alive(marks.entry[k], marks.exit[k]) for k in range(n)]
    at_exit = [alive_at(marks.exit[k]) for k in range(n)]
    born = [
        sum(ledger.nbytes[s] for s in carried if marks.entry[k] < ledger.born_at[s] <= marks.exit[k] < death[s])
        for k in range(n)
    ]
    made = [s for s in range(len(ledger.nbytes)) if not ledger.born_forward[s] and s not in param_grads]
    head = [s for s in range(len(ledger.nbytes)) if ledger.born_forward[s] and ledger.born_in[s] == gap_region(n)]
    bwd = []
    for k in range(n):
        t0, t1 = window_start[k], window_end[k]
        grads = sum(
            ledger.nbytes[s] for s in made
            if ledger.born_at[s] <= t0 and (ledger.died_at[s] is None or ledger.died_at[s] > t0) and s != own_grad.get(k)
        )
        held = sum(
            ledger.nbytes[s] for s in head
            if ledger.born_at[s] <= t1 and (ledger.died_at[s] is None or ledger.died_at[s] > t0)
        )
        bwd.append(alive(t0, t1) + grads + held)
    end = at_exit[-1] if n else 0
    return CarriedTerms(frozenset(carried), fwd, bwd, at_exit, born, end)
