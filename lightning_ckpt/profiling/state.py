"""Everything a profiling step may change, put back as it was: RNG streams,
buffers, `.grad` of every parameter, train/eval modes and torchmetrics states."""

from __future__ import annotations

import contextlib
import random

import torch
from torch import nn


@contextlib.contextmanager
def preserved_state(model: nn.Module):
    """Restore RNG streams, buffers and `.grad` of every parameter on exit."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py_rng = random.getstate()
    try:
        import numpy as np

        np_rng = np.random.get_state()
    except ImportError:  # pragma: no cover
        np_rng = None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    params = list(model.parameters())
    grads = [p.grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    metrics = [(m, _metric_state(m)) for m in model.modules() if _is_metric(m)]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, copy in buffers:
                b.copy_(copy)
        for m, mode in modes:
            m.training = mode
        for m, state in metrics:
            for k, v in state.items():
                setattr(m, k, v)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np_rng is not None:
            import numpy as np

            np.random.set_state(np_rng)


def _is_metric(m: nn.Module) -> bool:
    """A torchmetrics `Metric` (duck-typed: its states live outside buffers)."""
    return isinstance(getattr(m, "_defaults", None), dict) and hasattr(m, "_update_count")


def _metric_state(m: nn.Module) -> dict:
    import copy

    keys = [*m._defaults, "_update_count", "_computed"]
    return {k: copy.deepcopy(getattr(m, k)) for k in keys if hasattr(m, k)}
