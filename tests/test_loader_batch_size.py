"""The loader's batch size: set through the module or datamodule attribute, checked on the first batch."""

from __future__ import annotations

import pytest
import torch
from lit_models import LitChain, TokenData, make_trainer

from lightning_ckpt.integrations.loader_batch_size import (
    check_first_batch,
    set_loader_batch_size,
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
