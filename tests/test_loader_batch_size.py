"""The loader's batch size: set through the module or datamodule attribute, checked on the first batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities import CombinedLoader
from lit_models import LitChain, TokenData, make_trainer
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_ckpt.frontends.lightning.loader_batch_size import (
    check_first_batch,
    set_loader_batch_size,
    train_dataset_len,
)


def test_first_batch_of_another_size_says_how_to_expose_the_attribute():
    batch = (torch.zeros(4, 3), torch.zeros(4))
    check_first_batch(batch, 4, "batch_size")
    check_first_batch(batch, None, "batch_size")  # 'max' before planning: any size
    with pytest.raises(ValueError, match=r"has 4 samples but the planned batch size is 8; .* Expose 'bs' \(or set batch_arg_name\)"):
        check_first_batch(batch, 8, "bs")


def test_datamodule_attribute_is_set_and_loaders_rebuilt():
    data = TokenData(batch_size=4)
    trainer = make_trainer(max_steps=0)
    model = LitChain()
    trainer.fit(model, datamodule=data)  # attaches the datamodule; no step runs
    set_loader_batch_size(trainer, model, "batch_size", 8)
    assert data.batch_size == 8
    assert next(iter(trainer.train_dataloader))[0].shape[0] == 8
    set_loader_batch_size(trainer, model, "no_such_attribute", 2)  # not exposed: left to the first-batch check
    assert data.batch_size == 8


def test_dataset_smaller_than_the_planned_batch_is_named_as_the_cause():
    batch = (torch.zeros(6, 3), torch.zeros(6))
    with pytest.raises(
        ValueError,
        match=r"has 6 samples but the planned batch size is 8: the training dataset has only 6 samples, fewer than "
        r"the planned batch of 8, so no batch of that size exists\. Lower target_batch_size to at most 6 or add data",
    ):
        check_first_batch(batch, 8, "batch_size", dataset_len=6)
    with pytest.raises(ValueError, match=r"Expose 'batch_size' \(or set batch_arg_name\)"):
        check_first_batch(batch, 8, "batch_size", dataset_len=100)  # enough data: the loader ignored the size
    check_first_batch(batch, 6, "batch_size", dataset_len=6)


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


def _loader(n: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(n, 2)), batch_size=2)


@pytest.mark.parametrize(
    ("loaders", "expected"),
    [
        (None, None),
        (_loader(10), 10),
        ([_loader(7)], 7),
        ({"text": _loader(5)}, 5),
        (CombinedLoader(_loader(3)), 3),
        ({"a": _loader(5), "b": _loader(9)}, None),  # several loaders: their batches combine
        (DataLoader(_Stream(), batch_size=2), None),  # an IterableDataset has no length
    ],
)
def test_train_dataset_len_of_each_kind_of_train_loader(loaders, expected):
    assert train_dataset_len(SimpleNamespace(train_dataloader=loaders)) == expected


def test_train_dataset_len_of_a_fitted_trainer():
    trainer = make_trainer(max_steps=0)
    assert train_dataset_len(trainer) is None  # before fit: no loader yet
    trainer.fit(LitChain(), datamodule=TokenData(batch_size=4, n=20))
    assert train_dataset_len(trainer) == 20
