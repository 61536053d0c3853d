"""The train loader's batch size, changed the way Lightning's `BatchSizeFinder` changes it.

The size lives in an attribute of the LightningModule, its hparams or the datamodule
(`lightning_setattr`); after a change the train and val loaders are rebuilt. The first
batch that arrives is checked against the planned size.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)

from lightning_ckpt.profiling.batch import batch_size_of


def set_loader_batch_size(trainer: pl.Trainer, pl_module: pl.LightningModule, attr: str, size: int) -> None:
    """Set `attr` to `size` and rebuild the loaders; without `attr` the first batch is checked instead."""
    if not lightning_hasattr(pl_module, attr):
        return
    current = lightning_getattr(pl_module, attr)
    if current == size:
        return
    lightning_setattr(pl_module, attr, size)
    rank_zero_info(f"lightning-ckpt: {attr} {current} -> {size}")
    reload_dataloaders(trainer)


def reload_dataloaders(trainer: pl.Trainer) -> None:
    """Rebuild the train and val loaders after a batch size change (as `BatchSizeFinder` does)."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    val_loop = loop.epoch_loop.val_loop
    val_loop._combined_loader = None
    val_loop.setup_data()


def first_train_batch(trainer: pl.Trainer) -> Any:
    """One batch of the current train loader, on the device and in the precision's input type."""
    trainer.fit_loop.setup_data()
    batch = next(iter(trainer.train_dataloader))
    return trainer.strategy.batch_to_device(trainer.precision_plugin.convert_input(batch))


def check_first_batch(batch: Any, planned: int | None, attr: str) -> None:
    """The first training batch must have the planned size (None: not known yet)."""
    n = batch_size_of(batch)
    if planned is not None and n != planned:
        raise ValueError(
            f"the first training batch has {n} samples but the planned batch size is {planned}; "
            f"lightning-ckpt sets the loader's batch size through the attribute {attr!r} on the "
            "LightningModule, its hparams or the datamodule, and none was found or the loader ignores it. "
            f"Expose {attr!r} (or set batch_arg_name) or build the loader with the target batch size."
        )
