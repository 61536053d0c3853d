"""A Lightning fit watched from outside the library: a `StorageWindow` (`storage_oracle`) open from before the
fit's first hook to its end reads, at each training step's start and at the fit's end, the storages alive
against the state that has to be (parameters, buffers, gradients, optimizer state, the batch), and the peak
of the first batch, its profiling included. Budgets for these checks come from steps the same window measures.
Used by `test_profile_budget.py` and `benchmarks/profile_leftovers.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from hf_models import VOCAB, CausalTokens, LitHF
from lit_models import make_trainer
from storage_oracle import StorageWindow, distinct_bytes
from torch import nn


def llama(layers: int, hidden: int, lora_rank: int | None = None) -> nn.Module:
    """HF Llama from config (4 heads, attention dropout 0.1, eager attention, no cache), seeded; with
    `lora_rank`, peft's LoRA of that rank on `q_proj` and `v_proj` (the base weights frozen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.1,
                         max_position_embeddings=4096, attn_implementation="eager", use_cache=False)
    model = LlamaForCausalLM(config)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=["q_proj", "v_proj"]))
    return model.train()


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of `llama`'s model, LoRA-wrapped or not."""
    inner = model.base_model.model if hasattr(model, "peft_config") else model
    return list(inner.model.layers)


def state_of(module: nn.Module, optimizers: list[torch.optim.Optimizer], batch: Any = None) -> list[torch.Tensor]:
    """What a step finds alive by right: parameters, buffers, gradients, optimizer state, the batch."""
    params = list(module.parameters())
    out = params + list(module.buffers()) + [p.grad for p in params if p.grad is not None]
    out += [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if batch is not None:
        out += [v for v in batch.values() if isinstance(v, torch.Tensor)]
    return out


@dataclass
class Reading:
    """Bytes alive in the window at one moment, and the state's bytes then (each storage once)."""

    where: str
    alive_bytes: int
    state_bytes: int
    extra: list[tuple[int, str]] = field(default_factory=list)  # the largest alive storages not in the state

    @property
    def ratio(self) -> float:
        return self.alive_bytes / self.state_bytes


class StepStarts(pl.Callback):
    """Reads the window at each training step's start, right after the library's batch-start hook (where it
    profiles; put this callback after the library's), and at the end of training. No garbage collection
    before a reading: what a reference cycle keeps counts as alive."""

    def __init__(self, window: StorageWindow) -> None:
        self.window, self.readings = window, []

    def _read(self, where: str, pl_module: pl.LightningModule, optimizers: list, batch: Any = None) -> None:
        state = state_of(pl_module, optimizers, batch)
        mine = {t.untyped_storage().data_ptr() for t in state}
        extra = sorted(((n, op) for ptr, (n, op) in self.window.snapshot().items() if ptr not in mine), reverse=True)
        self.readings.append(Reading(where, self.window.alive_bytes(), distinct_bytes(state), extra[:5]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._read(f"step {batch_idx} start", pl_module, list(trainer.optimizers), batch)

    def on_train_end(self, trainer, pl_module):
        self._read("fit end", pl_module, list(trainer.optimizers))


class FirstBatchPeak(pl.Callback):
    """The window's peak over the first training batch, from its start (put this callback before the
    library's, so that its batch-start hook, the profiling, is inside) to its end."""

    def __init__(self, window: StorageWindow) -> None:
        self.window, self.peak_bytes = window, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.window.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.peak_bytes = self.window.peak_bytes


def watched_fit(model: nn.Module, length: int, callback: pl.Callback, precision: str,
                steps: int = 3) -> tuple[list[Reading], int]:
    """Fit `model` on `steps` batches of one sequence of `length` tokens with `callback`, inside a window
    opened before the trainer's first hook -> (the readings at each step's start and the fit's end, the
    first batch's peak)."""
    data = CausalTokens(batch_size=1, n=steps, seq=length)  # (its tokens made before the window opens)
    window = StorageWindow()
    lit, first, starts = LitHF(model), FirstBatchPeak(window), StepStarts(window)
    trainer = make_trainer([first, callback, starts], max_steps=steps, precision=precision)
    with window:
        window.count([*lit.parameters(), *lit.buffers()])
        trainer.fit(lit, datamodule=data)
    return starts.readings, first.peak_bytes


def measured_peak(model: nn.Module, step_fn: Callable[[Any], torch.Tensor], batch: Any, checkpointed: bool) -> int:
    """The window's peak over a steady AdamW step (the second: optimizer state exists), the state counted,
    with every decoder layer its own checkpointed segment or none."""
    from lightning_ckpt.apply.segments import apply_segments

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    blocks = layers_of(model)
    handle = apply_segments(blocks, [(i, i) for i in range(len(blocks))]) if checkpointed else None
    try:
        for _ in range(2):  # (no garbage collection first: the window counts only what it sees made)
            with StorageWindow() as window:
                window.count(state_of(model, [opt], batch))
                window.reset_peak()
                loss = step_fn(batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
                del loss
    finally:
        if handle is not None:
            handle.remove()
    return window.peak_bytes


def budget_between(build: Callable[[], nn.Module], bf16: bool, batch: Any, share: float) -> tuple[int, int, int]:
    """(budget, full, none): `share` of the way from the measured peak of a step with every layer checkpointed
    to that of the unplanned step, each on a model `build` makes."""
    peaks = []
    for checkpointed in (True, False):
        model = build()
        peaks.append(measured_peak(model, step_fn(model, bf16), batch, checkpointed))
    full, none = peaks
    return int(full + share * (none - full)), full, none


def step_fn(model: nn.Module, bf16: bool) -> Callable[[Any], torch.Tensor]:
    """The forward and loss of a step, under CPU bf16 autocast (as Lightning's `bf16-mixed`) or not."""

    def fn(batch):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            return model(**batch).loss

    return fn


def causal_batch(length: int, seed: int = 0) -> dict:
    ids = torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}
