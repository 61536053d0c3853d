"""Each block's backward cut where its parameter gradients are made and written (`BlockCost.bwd_phase_bytes`).

A block's backward scratch is the peak of its live bytes above the backward's start, and which op reaches
it moves as the batch grows: at small batches the parameter gradients the block makes (the same at every
batch size), at large ones its activation gradients. A line through the peaks of two small probes then
misses the peak at the batch (low: a peak over ops is convex in the batch). Cut at every birth and every
write of a parameter gradient, each stretch holds its parameter gradients fixed: what grows with the batch
is the peak of the rest, one line per stretch (`costs.linear_fit`). The gradients in flight (made, not yet
written) are what a backward into existing gradients holds of them: autograd adds each into `.grad` in
place and frees it. Plain Python over the storage ledger's ticks (`lifetimes.StorageLedger`).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_ckpt.profiling.memory.lifetimes import StorageLedger

__all__ = ["backward_phases"]

Phase = tuple[int, int, int]  # (peak of all but parameter gradients, gradients made, gradients in flight)


def backward_phases(
    ledger: StorageLedger,
    windows: Sequence[tuple[int, int] | None],
    writes: Sequence[Sequence[tuple[int, int]]],
) -> list[tuple[Phase, ...]]:
    """Per block, the stretches of its backward window (ticks (t0, t1] of `ledger`; None: no window):
    `writes[i]` holds (serial, tick) of each parameter gradient written into `.grad` while block i's
    window was open, at the ledger's tick then (after that tick's event). Live bytes are counted from the
    window's start, as `bwd_transient_bytes` is."""
    grads = {s for block in writes for s, _ in block}
    delta = [0] * (ledger.tick + 1)  # each tick is one birth or one death
    born_grad: dict[int, int] = {}
    died_grad: dict[int, int] = {}
    for s, nbytes in enumerate(ledger.nbytes):
        delta[ledger.born_at[s]] = nbytes
        died = ledger.died_at[s]
        if died is not None:
            delta[died] = -nbytes
        if s in grads:
            born_grad[ledger.born_at[s]] = s
            if died is not None:
                died_grad[died] = s
    out: list[tuple[Phase, ...]] = []
    for window, written in zip(windows, writes):
        out.append(() if window is None else _phases(ledger, delta, born_grad, died_grad, window, written))
    return out


def _phases(
    ledger: StorageLedger, delta: list[int], born_grad: dict[int, int], died_grad: dict[int, int],
    window: tuple[int, int], written: Sequence[tuple[int, int]],
) -> tuple[Phase, ...]:
    t0, t1 = window
    at: dict[int, list[int]] = {}
    for s, tick in written:
        at.setdefault(max(tick, t0), []).append(s)
    phases: list[Phase] = []
    live = made = flight = peak = 0  # peak: of live - made in the open stretch

    def cut() -> None:
        nonlocal peak
        phases.append((peak, made, flight))
        peak = live - made  # the rest is continuous: the next stretch starts where this one ended

    for s in at.get(t0, ()):  # written before any event of the window
        cut()
        flight -= ledger.nbytes[s]
    for t in range(t0 + 1, t1 + 1):
        s = born_grad.get(t)
        if s is not None:  # a parameter gradient made: in flight until it is written
            cut()
            made += ledger.nbytes[s]
            flight += ledger.nbytes[s]
        elif t in died_grad and t0 < ledger.born_at[died_grad[t]]:  # replaced by a sum (a module called twice)
            cut()
            made -= ledger.nbytes[died_grad[t]]
        live += delta[t]
        peak = max(peak, live - made)
        for s in at.get(t, ()):
            cut()
            flight -= ledger.nbytes[s]
    phases.append((peak, made, flight))
    return tuple(phases)
