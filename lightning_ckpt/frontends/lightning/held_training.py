"""The user's training step run for profiling without training anything.

While the callback profiles, every optimizer's `step` and `zero_grad` (Lightning's wrappers and
the optimizers they wrap) and every lr scheduler's `step` do nothing, so neither the model nor
Lightning's progress counters (`global_step`) move; optimizer and scheduler state, `requires_grad`
flags and the rest of `profiling.forward_state.state` come back as found on every path. Under manual optimization
`manual_backward` records its losses instead of running backward: the profiler runs one backward through
all of them itself.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl

from lightning_ckpt.profiling.forward_state.state import preserved_state, unchanged_parameters

StepFn = Callable[[Any], Any]


@contextlib.contextmanager
def held_training(trainer: pl.Trainer, pl_module: pl.LightningModule, step_fn: StepFn) -> Iterator[StepFn]:
    """-> the step function to profile: `step_fn`, or under manual optimization `step_fn` with
    `manual_backward` recorded (`ManualStep`). Inside, optimizer and scheduler steps are no-ops;
    on exit everything is as found, and a parameter written in place raises."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(unchanged_parameters(pl_module))  # checked last, after everything is put back
        stack.enter_context(preserved_state(pl_module))
        stack.enter_context(_held_optimizers(trainer))
        stack.enter_context(_held_schedulers(trainer))
        stack.enter_context(_kept_attribute(pl_module, "_param_requires_grad_state"))  # `toggle_optimizer`'s record
        if pl_module.automatic_optimization:
            yield step_fn
        else:
            yield stack.enter_context(_manual_step(step_fn, pl_module))


# ----------------------------------------------------------------------------- optimizers and schedulers


def _skipped_step(closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
    """An optimizer step that updates nothing; a closure still runs once, as a real step runs it."""
    return closure() if closure is not None else None


def _skipped(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _instance_attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set `obj.name` on the instance; put back what the instance had (torch's schedulers wrap `step` there)."""
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def _kept_attribute(obj: Any, name: str) -> Iterator[None]:
    """Put back the value of `obj.name` (a shallow copy of a dict) on exit."""
    missing = object()
    old = getattr(obj, name, missing)
    kept = dict(old) if isinstance(old, dict) else old
    try:
        yield
    finally:
        if kept is not missing:
            setattr(obj, name, kept)


@contextlib.contextmanager
def _held_optimizers(trainer: pl.Trainer) -> Iterator[None]:
    """`step` and `zero_grad` of every optimizer and its Lightning wrapper are no-ops inside: the wrapper's
    `step` is what moves Lightning's progress counters. Each optimizer's `state` and `param_groups`
    values come back as found (their tensors are not copied: no step runs to change them)."""
    raw = list(trainer.optimizers)
    wrappers = list(getattr(trainer.strategy, "_lightning_optimizers", []))
    restores = [_optimizer_restorer(opt) for opt in raw]
    with contextlib.ExitStack() as stack:
        for opt in (*wrappers, *raw):
            stack.enter_context(_instance_attribute(opt, "step", _skipped_step))
            stack.enter_context(_instance_attribute(opt, "zero_grad", _skipped))
        try:
            yield
        finally:
            for restore in restores:
                restore()


def _optimizer_restorer(opt: Any) -> Callable[[], None]:
    """A function that puts `opt.state` (its per-parameter dicts, same objects) and the values of
    `opt.param_groups` back as they are now."""
    state = getattr(opt, "state", None)
    entries = [(k, inner, dict(inner)) for k, inner in state.items()] if isinstance(state, dict) else []
    groups = getattr(opt, "param_groups", None)
    values = [(g, {k: v for k, v in g.items() if k != "params"}) for g in groups] if isinstance(groups, list) else []

    def restore() -> None:
        if isinstance(state, dict):
            keep = {id(k) for k, _, _ in entries}
            for k in [k for k in state if id(k) not in keep]:
                del state[k]
            for k, inner, content in entries:
                state[k] = inner
                if inner.keys() != content.keys() or any(inner[x] is not content[x] for x in content):
                    inner.clear()
                    inner.update(content)
        for group, saved in values:
            for k in [k for k in group if k != "params" and k not in saved]:
                del group[k]
            group.update(saved)

    return restore


@contextlib.contextmanager
def _held_schedulers(trainer: pl.Trainer) -> Iterator[None]:
    """Every lr scheduler's `step` is a no-op inside; its `state_dict()` is loaded back on exit."""
    schedulers = [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", None) or []]
    saved = [
        (s, copy.deepcopy(s.state_dict())) for s in schedulers
        if callable(getattr(s, "state_dict", None)) and callable(getattr(s, "load_state_dict", None))
    ]
    with contextlib.ExitStack() as stack:
        for s in schedulers:
            stack.enter_context(_instance_attribute(s, "step", _skipped))
        try:
            yield
        finally:
            for s, state in saved:
                s.load_state_dict(state)


# ----------------------------------------------------------------------------- manual optimization


class ManualStep:
    """`step_fn` of a manually optimized module, made profilable: `backward` stands in for
    `manual_backward` and records each loss; a call returns their sum, so the profiler runs one
    backward through every pass of the step (a GAN's generator and discriminator passes, each its own
    `manual_backward`). Their graphs are then alive together, which the real step, with a backward
    after each pass, never exceeds. A step that neither calls it nor returns a loss is refused."""

    def __init__(self, step_fn: StepFn) -> None:
        self.step_fn = step_fn
        self.losses: list[Any] = []

    def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        self.losses.append(loss)

    def __call__(self, batch: Any) -> Any:
        self.losses = []
        out = self.step_fn(batch)
        losses, self.losses = self.losses, []
        if losses:
            return losses[0] if len(losses) == 1 else sum(loss.sum() for loss in losses[1:]) + losses[0].sum()
        if out is None:
            raise ValueError(
                "training_step (automatic_optimization=False) neither called self.manual_backward(loss) nor "
                "returned a loss; lightning-ckpt profiles the step's forward and backward, so it needs the loss. "
                "Call self.manual_backward(loss) in the step, or return the loss."
            )
        return out  # checked as a loss by the profiler


@contextlib.contextmanager
def _manual_step(step_fn: StepFn, pl_module: pl.LightningModule) -> Iterator[ManualStep]:
    """`ManualStep` with `pl_module.manual_backward` replaced by its `backward`, undone on exit."""
    step = ManualStep(step_fn)
    with _instance_attribute(pl_module, "manual_backward", step.backward):
        yield step
