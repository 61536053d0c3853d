"""Small LightningModules and data for callback tests."""

from __future__ import annotations

import copy
import random
import tempfile

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from models import TinyChain
from torch.utils.data import DataLoader, TensorDataset


class LitChain(pl.LightningModule):
    def __init__(self, n_blocks: int = 6, d: int = 32, p: float = 0.1, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyChain(n_blocks=n_blocks, d=d, vocab=50, n_classes=3, p=p)
        self.losses: list[torch.Tensor] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())
        self.last_grads = {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TokenData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4, n: int = 64, seq: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 50, (n, seq), generator=g)
        y = (x[:, 0] % 3).long()
        self.ds = TensorDataset(x, y)

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=False)


def make_trainer(callbacks=(), max_steps: int = 3, **kw) -> pl.Trainer:
    kw.setdefault("default_root_dir", tempfile.mkdtemp(prefix="lckpt-"))
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=kw.pop("enable_checkpointing", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )


class LitLazyChain(LitChain):
    """`LitChain` whose network is built in `configure_model`, as Lightning recommends for sharded
    training: before that hook (in `setup`) the module has no blocks."""

    def __init__(self, n_blocks: int = 6, d: int = 32, p: float = 0.1, lr: float = 0.05) -> None:
        super(LitChain, self).__init__()  # LightningModule's: no network here
        self.save_hyperparameters()
        self.net: TinyChain | None = None
        self.losses = []

    def configure_model(self) -> None:
        if self.net is None:  # Lightning may call it again (e.g. a second fit)
            h = self.hparams
            self.net = TinyChain(n_blocks=h.n_blocks, d=h.d, vocab=50, n_classes=3, p=h.p)


class LitKeptOptimizer(LitChain):
    """`LitChain` whose AdamW is built once and returned by every fit, so its state exists before a fit."""

    def __init__(self, n_blocks: int = 6, d: int = 32, p: float = 0.1, lr: float = 0.05) -> None:
        super().__init__(n_blocks, d, p, lr)
        self.kept = None

    def build_optimizers(self) -> tuple[list[torch.optim.Optimizer], list]:
        return [torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)], []

    def configure_optimizers(self):
        if self.kept is None:
            self.kept = self.build_optimizers()
        optimizers, schedulers = self.kept
        return (optimizers, schedulers) if schedulers else optimizers


class LitManual(LitKeptOptimizer):
    """`LitKeptOptimizer` trained by manual optimization: one forward and one `manual_backward` per
    step, the optimizers stepped by hand. `n_optimizers=2` splits the parameters (embedding and the
    first half of the blocks, the rest) between two AdamWs, both stepped; `scheduler` adds a StepLR
    on the first, stepped by hand after the optimizers; `toggle` runs the step inside
    `toggle_optimizer` of the first optimizer (the others' parameters then get no gradient)."""

    def __init__(
        self, n_blocks: int = 6, d: int = 32, p: float = 0.1, lr: float = 0.05, n_optimizers: int = 1,
        scheduler: bool = False, toggle: bool = False,
    ) -> None:
        super().__init__(n_blocks, d, p, lr)
        self.automatic_optimization = False
        self.n_optimizers, self.scheduler, self.toggle = n_optimizers, scheduler, toggle

    def build_optimizers(self) -> tuple[list[torch.optim.Optimizer], list]:
        lr = self.hparams.lr
        if self.n_optimizers == 1:
            optimizers = [torch.optim.AdamW(self.parameters(), lr=lr)]
        else:
            half = len(self.net.blocks) // 2
            first = [*self.net.embed.parameters(), *self.net.blocks[:half].parameters()]
            ids = {id(p) for p in first}
            rest = [p for p in self.parameters() if id(p) not in ids]
            optimizers = [torch.optim.AdamW(first, lr=lr), torch.optim.AdamW(rest, lr=lr)]
        schedulers = [torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=0.5)] if self.scheduler else []
        return optimizers, schedulers

    def all_optimizers(self) -> list:
        optimizers = self.optimizers()
        return optimizers if isinstance(optimizers, list) else [optimizers]

    def training_step(self, batch, batch_idx):
        optimizers = self.all_optimizers()
        if self.toggle:
            self.toggle_optimizer(optimizers[0])
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()
        if self.scheduler:
            self.lr_schedulers().step()
        if self.toggle:
            self.untoggle_optimizer(optimizers[0])
        self.log("train_loss", loss)
        return loss


class LitTwoPasses(LitManual):
    """Two forward/backward passes per step, as a GAN's discriminator and generator steps:
    `passes="forwards"` runs the network twice, each time stepped; `passes="backwards"` runs it once
    and calls `manual_backward` on two losses."""

    def __init__(self, passes: str = "forwards", **kwargs) -> None:
        super().__init__(**kwargs)
        self.passes = passes

    def training_step(self, batch, batch_idx):
        (opt,) = self.all_optimizers()
        x, y = batch
        if self.passes == "forwards":
            for _ in range(2):
                loss = torch.nn.functional.cross_entropy(self(x), y)
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(logits.square().mean())
        opt.step()
        return loss


class LitNoBackward(LitManual):
    """Manual optimization whose `training_step` neither calls `manual_backward` nor returns a loss."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        torch.nn.functional.cross_entropy(self(x), y)


class SeededTokenData(TokenData):
    """`TokenData` whose loader draws from a generator of its own (`shuffle`: in a random order), so
    iterating it leaves torch's global RNG alone; without `seed` the shuffling draws from torch's."""

    def __init__(self, batch_size: int = 4, n: int = 64, seq: int = 16, shuffle: bool = False, seed: int | None = 0):
        super().__init__(batch_size, n, seq)
        self.shuffle, self.seed = shuffle, seed

    def train_dataloader(self):
        g = None if self.seed is None else torch.Generator().manual_seed(self.seed)
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=self.shuffle, generator=g)


def with_optimizer_state(model: LitKeptOptimizer, batch) -> LitKeptOptimizer:
    """`model` after one step by hand on `batch` (its gradients left in place): its optimizers and
    schedulers have state before any fit."""
    optimizers, schedulers = model.kept = model.build_optimizers()
    x, y = batch
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for opt in optimizers:
        opt.step()
    for scheduler in schedulers:
        scheduler.step()
    return model


def training_state(model: LitKeptOptimizer) -> dict:
    """Copies of everything profiling must leave as found: parameters (values, `_version`,
    `requires_grad`), buffers, gradients, the kept optimizers' state (tensors and their `_version`)
    and param groups, the schedulers' state, RNG streams and train modes."""
    optimizers, schedulers = getattr(model, "kept", None) or ([], [])
    index = {id(p): i for i, p in enumerate(model.parameters())}

    def optimizer(opt) -> dict:
        state = {
            index[id(p)]: {k: (v.clone(), v._version) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in opt.state.items()
        }
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return {"state": state, "groups": groups}

    return {
        "params": {n: (p.detach().clone(), p._version, p.requires_grad) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "optimizers": [optimizer(o) for o in optimizers],
        "schedulers": [copy.deepcopy(s.state_dict()) for s in schedulers],
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "modes": [m.training for m in model.modules()],
    }


def same(a, b) -> bool:
    """Equal bit for bit, through dicts, lists and tuples of tensors, arrays and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_state(before: dict, after: dict) -> None:
    """`training_state` snapshots equal, naming the first part (and parameter) that differs."""
    assert before.keys() == after.keys()
    for part in before:
        if isinstance(before[part], dict):
            assert before[part].keys() == after[part].keys(), part
            for name in before[part]:
                assert same(before[part][name], after[part][name]), f"{part}: {name}"
        else:
            assert same(before[part], after[part]), part


class FirstBatchState(Callback):
    """`training_state` of the module and Lightning's counters (`global_step`, the fit loop's
    progress) at the first `on_train_batch_start` and in `on_exception`. Lightning sets the
    gradients to None when fit starts: `grads` (by parameter name) are put back first, as a
    micro-batch before this one would have left them. List it before the callback under test."""

    def __init__(self, grads: dict[str, torch.Tensor] | None = None) -> None:
        self.grads = grads
        self.at_start: dict | None = None
        self.at_exception: dict | None = None

    @staticmethod
    def _state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        progress = {"global_step": trainer.global_step, "fit_loop": copy.deepcopy(trainer.fit_loop.state_dict())}
        return {**training_state(pl_module), "progress": progress}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at_start is None:
            for name, p in pl_module.named_parameters():
                if self.grads is not None and name in self.grads:
                    p.grad = self.grads[name].clone()
            self.at_start = self._state(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception):
        self.at_exception = self._state(trainer, pl_module)
