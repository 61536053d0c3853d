"""The train loader's batch size, changed the way Lightning's `BatchSizeFinder` changes it.

The size lives in an attribute of the LightningModule, its hparams or the datamodule
(`lightning_setattr`); after a change the train and val loaders are rebuilt. The first
batch that arrives is checked against the planned size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import CombinedLoader, rank_zero_info
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)

from lightning_ckpt.profiling.structure.batch import batch_size_of
from lightning_ckpt.profiling.forward_state.state import preserved_rng


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
    """One batch of the current train loader, on the device and in the precision's input type.
    Every RNG stream is left as found (a shuffling sampler draws from torch's generator), so training
    then sees the same batches and dropout masks as without this look."""
    with preserved_rng():
        trainer.fit_loop.setup_data()
        batch = next(iter(trainer.train_dataloader))
    return trainer.strategy.batch_to_device(trainer.precision_plugin.convert_input(batch))


def check_first_batch(batch: Any, planned: int | None, attr: str, dataset_len: int | None = None) -> None:
    """The first training batch must have the planned size (None: not known yet).

    `dataset_len`, the number of training samples when known, tells a dataset smaller than the
    planned batch apart from a loader that did not take the batch size."""
    n = batch_size_of(batch)
    if planned is not None and n != planned and dataset_len is not None and dataset_len < planned:
        raise ValueError(
            f"the first training batch has {n} samples but the planned batch size is {planned}: the training "
            f"dataset has only {dataset_len} samples, fewer than the planned batch of {planned}, so no batch of "
            f"that size exists. Lower target_batch_size to at most {dataset_len} or add data."
        )
    if planned is not None and n != planned:
        raise ValueError(
            f"the first training batch has {n} samples but the planned batch size is {planned}; "
            f"lightning-ckpt sets the loader's batch size through the attribute {attr!r} on the "
            "LightningModule, its hparams or the datamodule, and none was found or the loader ignores it. "
            f"Expose {attr!r} (or set batch_arg_name) or build the loader with the target batch size."
        )


def train_dataset_len(trainer: pl.Trainer) -> int | None:
    """The number of samples in the train loader's dataset; None without a loader, with several
    loaders (their batches combine) or for a dataset without `__len__` (an IterableDataset)."""
    loaders = trainer.train_dataloader  # the loader(s) as returned by train_dataloader(), or None
    if isinstance(loaders, CombinedLoader):
        loaders = loaders.iterables
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if len(loaders) == 1 else None
    dataset = getattr(loaders, "dataset", None)
    return len(dataset) if hasattr(dataset, "__len__") else None
