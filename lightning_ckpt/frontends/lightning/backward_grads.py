"""Whether a Lightning module's parameter gradients are alive through its backward, read where Lightning
calls `on_before_backward` (after `optimizer_zero_grad`, before the backward), so that plans count them.

Lightning's own order (forward, `zero_grad()` with `set_to_none=True`, backward) frees them before each
backward. A module that zeroes them in its own way (an `optimizer_zero_grad` override, say with
`set_to_none=False`, or manual optimization) may keep them: every gradient alive through the step, each new
one added into it in place, as in gradient accumulation. Until a backward shows which (the first backward of
a fresh model has none either way), such a module is planned as keeping them; a gradient seen alive at any
later backward holds from then on. Under `accumulate_grad_batches > 1` they are kept anyway, and not read.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

__all__ = ["BackwardGrads", "zeroes_its_own_way"]


def zeroes_its_own_way(pl_module: pl.LightningModule) -> bool:
    """The module zeroes its gradients itself: manual optimization or an `optimizer_zero_grad` override."""
    own = type(pl_module).optimizer_zero_grad is not pl.LightningModule.optimizer_zero_grad
    return own or not pl_module.automatic_optimization


class BackwardGrads:
    """What the backward passes of one fit showed of the gradients (`kept`: None until one shows it)."""

    def __init__(self, pl_module: pl.LightningModule) -> None:
        self.assumed = zeroes_its_own_way(pl_module)
        self.kept: bool | None = None
        self._backwards = 0

    @property
    def state(self) -> bool:
        """The gradients are alive through each backward (as seen, else as assumed)."""
        return self.assumed if self.kept is None else self.kept

    def observe(self, params: list[torch.Tensor]) -> None:
        """Read the gradients at a backward's start."""
        self._backwards += 1
        alive = any(p.grad is not None for p in params)
        if alive:
            self.kept = True
        elif self._backwards > 1 and self.kept is None:  # a backward after one that made them: freed
            self.kept = False

    def describe(self) -> str:
        how = "an optimizer_zero_grad override" if self.assumed else "the module"
        if self.state:
            return (f"the parameters' gradients are alive at the start of the backward ({how} zeroes them in place "
                    "or not at all): every gradient is alive through each step, each new one added into it")
        return (f"the parameters' gradients are freed before each backward (seen under {how}): the step makes each "
                "one in its backward")
