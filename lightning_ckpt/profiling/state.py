"""Everything a profiling step may change, put back as it was: RNG streams,
buffers, `.grad` and `requires_grad` of every parameter, train/eval modes and
torchmetrics states; and a check that no parameter was written in place."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore torch's CPU and CUDA generators, Python's `random` and NumPy's global state on exit."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py_rng = random.getstate()
    try:
        import numpy as np

        np_rng = np.random.get_state()
    except ImportError:  # pragma: no cover
        np_rng = None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np_rng is not None:
            import numpy as np

            np.random.set_state(np_rng)


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore RNG streams, buffers, `.grad` and `requires_grad` of every parameter, train
    modes and torchmetrics states on exit; `.grad` is None inside."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    params = list(model.parameters())
    grads = [p.grad for p in params]
    requires = [p.requires_grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    metrics = [(m, _metric_state(m)) for m in model.modules() if _is_metric(m)]
    with preserved_rng():
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            for p, g, r in zip(params, grads, requires):
                p.grad = g
                if p.requires_grad != r:
                    p.requires_grad_(r)
            with torch.no_grad():
                for b, copy in buffers:
                    b.copy_(copy)
            for m, mode in modes:
                m.training = mode
            for m, state in metrics:
                for k, v in state.items():
                    setattr(m, k, v)


@contextlib.contextmanager
def unchanged_parameters(model: nn.Module) -> Iterator[None]:
    """Raise on exit when a parameter of `model` was written in place inside (its `_version` moved).

    Parameters are not copied (that would double a large model's memory), so such a write cannot
    be undone, only reported. An exception already on its way out is left to propagate."""
    named = list(model.named_parameters())
    versions = [p._version for _, p in named]
    yield
    changed = [name for (name, p), v in zip(named, versions) if p._version != v]
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        raise RuntimeError(
            f"the training step modified {len(changed)} parameter(s) in place during profiling ({shown}); "
            "lightning-ckpt runs it on slices of the first batch to measure it and keeps no copy of the "
            "parameters, so the model is no longer as it was before fit. Change parameters only through the "
            "optimizers (their steps are skipped while profiling) or in a hook profiling does not run, such "
            "as on_train_batch_end."
        )


def _is_metric(m: nn.Module) -> bool:
    """A torchmetrics `Metric` (duck-typed: its states live outside buffers)."""
    return isinstance(getattr(m, "_defaults", None), dict) and hasattr(m, "_update_count")


def _metric_state(m: nn.Module) -> dict:
    import copy

    keys = [*m._defaults, "_update_count", "_computed"]
    return {k: copy.deepcopy(getattr(m, k)) for k in keys if hasattr(m, k)}
