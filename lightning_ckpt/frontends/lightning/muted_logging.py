"""`self.log` switched off while the callback's profiling steps run `training_step`.

Profiling calls the module's `training_step` on slices of a batch; what it logs there
is not a training step's metric and must not reach the loggers or the progress bar.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import lightning.pytorch as pl

_LOG_METHODS = ("log", "log_dict")


@contextlib.contextmanager
def muted_logging(module: pl.LightningModule) -> Iterator[None]:
    """Replace `module.log` and `module.log_dict` by no-ops; restore what was there after."""
    saved = {k: module.__dict__[k] for k in _LOG_METHODS if k in module.__dict__}
    for k in _LOG_METHODS:
        setattr(module, k, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for k in _LOG_METHODS:
            if k in saved:
                module.__dict__[k] = saved[k]
            else:
                module.__dict__.pop(k, None)
