"""What a strategy tells the callback: its own static memory and profiling context, or the defaults."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from lightning_ckpt.frontends.lightning.strategy_hooks import (
    profiling_context,
    strategy_static_memory,
)
from lightning_ckpt.profiling.memory.static_memory import StaticMemory, static_memory


def test_defaults_count_this_process_and_use_no_sync_when_the_model_has_it():
    module = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    trainer = SimpleNamespace(strategy=SimpleNamespace(), optimizers=[opt], model=module)
    assert strategy_static_memory(trainer, module) == static_memory(module, [opt])
    assert isinstance(profiling_context(trainer), contextlib.nullcontext)

    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append("no_sync")
        yield

    trainer.model = SimpleNamespace(no_sync=no_sync)
    with profiling_context(trainer):
        pass
    assert entered == ["no_sync"]


def test_strategy_hooks_take_precedence():
    own = StaticMemory(param_bytes=1, buffer_bytes=2, grad_bytes=3, optimizer_state_bytes=4, optimizer_transient_bytes=5)
    seen = []

    @contextlib.contextmanager
    def pause():
        seen.append("paused")
        yield

    strategy = SimpleNamespace(ckpt_static_memory=lambda module, optimizers: own, ckpt_profiling_context=pause)
    trainer = SimpleNamespace(strategy=strategy, optimizers=[], model=SimpleNamespace(no_sync=None))
    assert strategy_static_memory(trainer, torch.nn.Linear(2, 2)) is own
    with profiling_context(trainer):
        pass
    assert seen == ["paused"]
