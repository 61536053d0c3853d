"""Profiling a training step that computes its loss under tensor parallelism's `loss_parallel`.

`loss_parallel()` turns on DTensor handlers for cross-entropy on logits sharded over the classes, and
its backward needs them too; Lightning runs that backward in the module's `backward` hook, but the
profiler runs `loss.backward()` itself, after the step's context has closed. `held_loss_parallel`
keeps the handlers a step turned on until profiling ends, so the profiled backward takes the
training step's path; nothing changes for a step that does not use `loss_parallel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def held_loss_parallel() -> Iterator[None]:
    """Inside, leaving `loss_parallel()` keeps its handlers on; they are turned off on exit."""
    try:
        from torch.distributed.tensor.parallel import loss as tp_loss
    except ImportError:  # pragma: no cover - torch built without distributed
        yield
        return
    disable = tp_loss._disable_custom_loss_ops
    held = []
    tp_loss._disable_custom_loss_ops = lambda: held.append(True)
    try:
        yield
    finally:
        tp_loss._disable_custom_loss_ops = disable
        if held:
            disable()
