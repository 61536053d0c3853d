"""The example in examples/train_encoder.py: model shape, block chain, data, and that it learns."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from lightning_ckpt import ActivationCheckpointing

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_encoder.py"
CONFIG = ROOT / "configs" / "encoder48.yaml"


def _load_example():
    name = "train_encoder_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # jsonargparse resolves the classes through their module
    spec.loader.exec_module(module)
    return module


ex = _load_example()


def _small_model(**kwargs):
    args = dict(n_blocks=3, d_model=32, n_heads=4, seq_len=64, vocab_size=512, n_classes=4)
    args.update(kwargs)
    return ex.EncoderClassifier(**args)


def test_forward_shape():
    torch.manual_seed(0)
    model = _small_model()
    idx = torch.randint(0, 512, (5, 64))
    assert model(idx).shape == (5, 4)
    # Shorter sequences than the position table are fine too.
    assert model(idx[:, :10]).shape == (5, 4)


def test_blocks_are_a_chain_of_encoder_blocks():
    default = ex.EncoderClassifier()
    assert isinstance(default.blocks, torch.nn.ModuleList)
    assert len(default.blocks) == 48
    assert all(type(b) is ex.EncoderBlock for b in default.blocks)
    assert default.hparams.d_model == 128 and default.hparams.n_heads == 4 and default.hparams.seq_len == 128

    torch.manual_seed(0)
    model = _small_model(n_blocks=5).eval()
    assert len(model.blocks) == 5
    idx = torch.randint(0, 512, (2, 64))
    # The forward is embedding -> block by block, one tensor in and out -> head.
    x = model.tok_emb(idx) + model.pos_emb
    for block in model.blocks:
        y = block(x)
        assert isinstance(y, torch.Tensor) and y.shape == x.shape
        x = y
    logits = model.head(model.ln_f(x).mean(dim=1))
    torch.testing.assert_close(logits, model(idx), rtol=0, atol=0)


def test_attention_is_written_out():
    """No fused attention: the FLOP counter and saved-tensor accounting see plain ops."""
    model = _small_model(n_blocks=1)
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        model(torch.randint(0, 512, (1, 64)))
    assert not any("scaled_dot_product" in f or "flash" in f for f in seen), seen
    assert any("_softmax" in f for f in seen)


def test_datamodule_honours_changed_batch_size_on_reload():
    dm = ex.SyntheticTextDataModule(batch_size=16, n_train=256, n_val=64)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 128) and y.shape == (16,)
    dm.batch_size = 5
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (5, 128)
    assert next(iter(dm.val_dataloader()))[0].shape == (5, 128)


def test_batch_size_set_like_batch_size_finder_reaches_the_loader(tmp_path):
    """`lightning_setattr(model, "batch_size", n)` + loader reload, inside a real fit."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.utilities.parsing import (
        lightning_getattr,
        lightning_hasattr,
        lightning_setattr,
    )

    seen: list[int] = []

    class SetBatch(Callback):
        def on_train_start(self, trainer, pl_module):
            assert lightning_hasattr(pl_module, "batch_size")
            lightning_setattr(pl_module, "batch_size", 7)
            assert lightning_getattr(pl_module, "batch_size") == 7
            loop = trainer.fit_loop
            loop._combined_loader = None  # what BatchSizeFinder's reset does
            loop.setup_data()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch[0].shape[0])

    torch.manual_seed(0)
    model = _small_model(n_blocks=1, d_model=16, n_heads=2)
    dm = ex.SyntheticTextDataModule(batch_size=4, seq_len=64, n_train=64, n_val=16)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[SetBatch()], default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert dm.batch_size == 7
    assert seen == [7, 7]


def test_data_is_deterministic_for_a_seed():
    def tensors(seed, n_train=128):
        dm = ex.SyntheticTextDataModule(seed=seed, n_train=n_train, n_val=32)
        dm.setup("fit")
        return dm.train_set.tensors, dm.val_set.tensors, dm

    (xa, ya), (va, wa), dm_a = tensors(7)
    (xb, yb), (vb, wb), dm_b = tensors(7)
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(va, vb) and torch.equal(wa, wb)
    (xc, _), _, _ = tensors(8)
    assert not torch.equal(xa, xc)
    # The validation split does not depend on the size of the training split.
    _, (vd, wd), _ = tensors(7, n_train=64)
    assert torch.equal(va, vd) and torch.equal(wa, wd)
    # The shuffled training order is seeded too.
    first = [b[1] for b in dm_a.train_dataloader()]
    again = [b[1] for b in dm_b.train_dataloader()]
    assert all(torch.equal(p, q) for p, q in zip(first, again, strict=True))


def test_label_is_the_unique_most_frequent_keyword_group():
    dm = ex.SyntheticTextDataModule(n_train=512, n_val=8)
    dm.setup("fit")
    x, y = dm.train_set.tensors
    k = dm.keywords_per_class
    counts = torch.stack([((x >= c * k) & (x < (c + 1) * k)).sum(1) for c in range(dm.n_classes)], dim=1)
    top2 = counts.topk(2, dim=1).values
    assert torch.equal(counts.argmax(1), y)
    assert bool((top2[:, 0] > top2[:, 1]).all())
    assert bool((counts >= dm.min_plants).all())
    # Classes are roughly balanced, so chance is 1 / n_classes.
    assert torch.bincount(y, minlength=dm.n_classes).min() > 512 / dm.n_classes * 0.7


def test_tiny_config_learns_above_chance(tmp_path, monkeypatch):
    """4 blocks, 64 tokens, 120 steps through LightningCLI: val accuracy well above 25 %."""
    monkeypatch.setattr(sys, "argv", ["train_encoder.py"])  # LightningCLI gets `args` only
    cli = ex.main(
        [
            "fit",
            "--seed_everything=0",
            "--model=examples.train_encoder.EncoderClassifier",
            "--data=examples.train_encoder.SyntheticTextDataModule",
            "--model.n_blocks=4",
            "--model.d_model=64",
            "--model.seq_len=64",
            "--data.seq_len=64",
            "--data.n_train=2048",
            "--data.n_val=256",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.max_steps=120",
            "--trainer.val_check_interval=120",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert cli.trainer.global_step == 120
    val_acc = float(cli.trainer.callback_metrics["val_acc"])
    chance = 1 / cli.datamodule.n_classes
    assert val_acc > chance + 0.25, f"val_acc {val_acc:.3f} vs chance {chance:.2f}"


def test_default_config_parses_and_builds(tmp_path, monkeypatch):
    """configs/encoder48.yaml builds the 48-block model, the data and the callback (nothing runs)."""
    monkeypatch.setattr(sys, "argv", ["train_encoder.py"])
    cli = ex.main(["--config", str(CONFIG), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert len(cli.model.blocks) == 48
    assert cli.datamodule.seq_len == cli.model.hparams.seq_len
    assert cli.datamodule.vocab_size == cli.model.hparams.vocab_size
    assert cli.datamodule.n_classes == cli.model.hparams.n_classes
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, ActivationCheckpointing)]
    assert len(callbacks) == 1
