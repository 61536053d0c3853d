"""What a training loop you write does with its parameter gradients between steps, read from their `.grad`
at the start of each step (`CheckpointHandle.step`), so that plans count the gradients the step holds:

- freed before the forward (`zero_grad()`, torch's default `set_to_none=True`, at the end of a step): none in
  the forward, and the backward makes each and keeps it;
- freed after the forward (Lightning's order: forward, `zero_grad()`, backward): last step's alive in the
  forward only (`StepCost.grads_live_in_forward`);
- kept (`zero_grad(set_to_none=False)`, or none between backward passes, as in gradient accumulation): every
  gradient alive through the whole step, each new one added into it in place (`StepCost.grads_accumulate`).

A step's start tells them apart: no `.grad` (freed before); the `.grad` tensor seen at the last step's start,
written since (kept); or a new one: all zeros (zeroed in place: kept), else the last backward's (freed after
the forward). The most alive seen so far holds from then on: a loop that accumulates into fresh gradients
shows several. A loop that frees its gradients after `handle.step` but before the forward is read as freeing
them after the forward (one step's gradients counted in the forward too many). Plain reads of the
parameters, with no hook; one parameter with a gradient stands for all.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterable

import torch

__all__ = ["LoopGradients", "StepGrads"]


class StepGrads(enum.IntEnum):
    """The gradients a step holds, least first."""

    FREED = 0  # none in the forward; each one the backward makes stays
    FORWARD = 1  # last step's alive in the forward, freed before the backward
    KEPT = 2  # every one alive through the step, each new one added in place

    def describe(self) -> str:
        return {
            StepGrads.FREED: "the training loop frees its gradients before each forward (zero_grad() with "
            "set_to_none=True)",
            StepGrads.FORWARD: "the training loop's gradients of the last step are alive in the forward and "
            "freed before the backward (zero_grad() between them)",
            StepGrads.KEPT: "the training loop keeps its gradients between steps (zero_grad(set_to_none=False), "
            "or none between backward passes): every gradient is alive through each step, each new one added "
            "into it",
        }[self]


class LoopGradients:
    """The most alive `StepGrads` seen at the steps' starts (`observe`), from `FREED` on."""

    ZERO_CHECKED = 3  # gradients that must all be zeros to be read as zeroed in place

    def __init__(self) -> None:
        self.state = StepGrads.FREED
        self._last: tuple[torch.Tensor, weakref.ref, int] | None = None  # (parameter, its .grad, that one's version)

    def observe(self, params: Iterable[torch.Tensor]) -> StepGrads | None:
        """Read the gradients at a step's start; -> what they show, or None when nothing ran since the last read
        (the same `.grad`, not written since)."""
        with_grads = []
        for p in params:
            if p.grad is not None:
                with_grads.append(p)
                if len(with_grads) == self.ZERO_CHECKED:
                    break
        if not with_grads:
            self._last = None
            return self._see(StepGrads.FREED)
        p, last = with_grads[0], self._last
        grad = p.grad
        if last is not None and last[0] is p and last[1]() is grad:
            if grad._version == last[2]:
                return None  # read twice within one step
            seen = StepGrads.KEPT  # the same tensor, written since
        elif last is not None and last[0] is p:
            seen = StepGrads.FORWARD  # a new tensor: the last one was freed after its forward
        else:  # the first gradients seen: zeros were zeroed in place, else the last backward made them
            zeros = all(not bool(q.grad.detach().count_nonzero()) for q in with_grads)
            seen = StepGrads.KEPT if zeros else StepGrads.FORWARD
        self._last = (p, weakref.ref(grad), grad._version)
        return self._see(seen)

    def _see(self, seen: StepGrads) -> StepGrads:
        self.state = max(self.state, seen)
        return seen
