"""The two examples as the benchmarks build them: a seeded model and one training batch.

Shared by `plans.py` and `cost_metric.py`, so both measure the same models at the
same batch sizes as the configs (`quick` gives smaller ones for smoke runs).
"""

from __future__ import annotations

from typing import Any

import torch

CNN_CHAIN = ["stem", "layer1.*", "layer2.*", "layer3.*", "layer4.*"]


def encoder_example(quick: bool) -> tuple[torch.nn.Module, Any, int]:
    """(model, batch, batch size) of the text encoder (configs/encoder48.yaml unless `quick`)."""
    from train_encoder import EncoderClassifier, SyntheticTextDataModule

    torch.manual_seed(0)
    if quick:
        model, batch_size, seq = EncoderClassifier(n_blocks=12, d_model=64, seq_len=64), 8, 64
    else:
        model, batch_size, seq = EncoderClassifier(), 16, 128  # configs/encoder48.yaml
    data = SyntheticTextDataModule(batch_size=batch_size, seq_len=seq, n_train=4 * batch_size, n_val=batch_size)
    data.setup("fit")
    return model, next(iter(data.train_dataloader())), batch_size


def cnn_example(quick: bool) -> tuple[torch.nn.Module, Any, int]:
    """(model, batch, batch size) of the ResNet-style CNN (configs/cnn.yaml trains at 64)."""
    from train_cnn import ShapesDataModule, ShapesResNet

    torch.manual_seed(0)
    model = ShapesResNet()
    batch_size = 16 if quick else 64
    data = ShapesDataModule(batch_size=batch_size, n_train=4 * batch_size, n_val=batch_size)
    data.setup("fit")
    return model, next(iter(data.train_dataloader())), batch_size
