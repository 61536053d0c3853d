"""Profiling's own peak against the memory budget, measured by a live-storage count that is not the
library's (weak references to every storage an op makes, `tests/test_recompute_probe._LivePeak`), around
the whole `auto_checkpoint` call and the first steps, beside the same numbers for the plan's steps:

- `lm`: a causal LM of 8 attention-heavy blocks (d 32, one head) at batch 4 x 1,000 tokens, 120 MiB;
- `llama`: HF Llama from config (8 layers, hidden 128, 4 heads, attention dropout 0.1) at batch (1, 2048),
  a budget 10 % above the `full` plan's measured peak; losses compared with training without the library.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_peak.py [--cases lm llama]

Each case runs in this process one after the other; times are wall seconds on this machine, noisy.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples"), str(ROOT)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from test_recompute_probe import _LivePeak  # noqa: E402

from lightning_ckpt import auto_checkpoint  # noqa: E402
from lightning_ckpt.apply.segments import apply_segments  # noqa: E402

MiB = 2**20


class _Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        n = x.shape[1]
        att = (q @ k.transpose(1, 2)) / math.sqrt(x.shape[-1])
        att = att.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        x = x + self.proj(self.drop(att.softmax(-1)) @ v)
        return x + self.mlp(self.ln2(x))


class _LM(nn.Module):
    def __init__(self, n: int = 8, d: int = 32, vocab: int = 96) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.1,
                         max_position_embeddings=4096, attn_implementation="eager", use_cache=False)
    return LlamaForCausalLM(config)


def _held(model: nn.Module, batch) -> int:
    """What exists before the call and counts against the budget: parameters and the batch."""
    tensors = [*model.parameters(), *(batch.values() if isinstance(batch, dict) else [batch])]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _steps(model, step_fn, batches, handle=None) -> tuple[list[float], list[int]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if handle is None else handle.optimizer
    losses, peaks = [], []
    for batch in batches:
        if handle is not None:
            handle.step(batch)
        gc.collect()
        with _LivePeak() as seen:
            loss = step_fn(batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
        peaks.append(seen.peak)
        losses.append(float(loss))
    return losses, peaks


def _full_peak(model, blocks, step_fn, batch) -> int:
    """The `full` plan's step (every block checkpointed), measured; the optimizer's state included."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_fn(batch).backward()
    opt.step()
    opt.zero_grad()
    handle = apply_segments(blocks, [(i, i) for i in range(len(blocks))])
    try:
        gc.collect()
        with _LivePeak() as seen:
            step_fn(batch).backward()
            opt.step()
            opt.zero_grad()
    finally:
        handle.remove()
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return seen.peak + state


def run(name: str, model, step_fn, batches, budget: int, blocks: str) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = _held(model, batches[0])
    gc.collect()
    start = time.perf_counter()
    with _LivePeak() as seen:
        handle = auto_checkpoint(model, budget, example_batch=batches[0], step_fn=step_fn, optimizer=opt,
                                 blocks=blocks, verbose=False, info=lambda line: None)
    took = time.perf_counter() - start
    handle.optimizer = opt
    losses, peaks = _steps(model, step_fn, batches, handle)
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    steps = [p + held + state for p in peaks]
    plan = handle.plan
    print(
        f"{name:6s} budget {budget / MiB:7.1f} MiB | auto_checkpoint {(seen.peak + held) / budget:5.2f}x budget, "
        f"{took:5.1f} s | plan {len(plan.checkpointed)}/{plan.n_blocks} checkpointed, predicted "
        f"{plan.predicted_peak_bytes / budget:4.2f}x | steps {max(steps) / budget:4.2f}x budget (max of {len(steps)})"
    )
    handle.remove()
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["lm", "llama"], choices=["lm", "llama"])
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if "lm" in args.cases:
        torch.manual_seed(0)
        model = _LM()
        batches = [torch.randint(0, 96, (4, 1000), generator=torch.Generator().manual_seed(s)) for s in range(2)]
        run("lm", model, model, batches, 120 * MiB, "blocks")
    if "llama" in args.cases:
        batches = []
        for s in range(2):
            ids = torch.randint(0, 96, (1, 2048), generator=torch.Generator().manual_seed(s))
            batches.append({"input_ids": ids, "labels": ids.clone()})
        ref = _llama()
        ref.train()
        full = _full_peak(ref, list(ref.model.layers), lambda b: ref(**b).loss, batches[0])
        budget = int(1.1 * (full + _held(ref, batches[0])))
        plain = _llama()
        plain.train()
        ref_losses, ref_peaks = _steps(plain, lambda b: plain(**b).loss, batches)
        model = _llama()
        model.train()
        losses = run("llama", model, lambda b: model(**b).loss, batches, budget, "model.layers")
        print(f"       unplanned steps {max(ref_peaks) / budget:4.2f}x budget; losses equal to training without the "
              f"library: {losses == ref_losses}")


if __name__ == "__main__":
    main()
