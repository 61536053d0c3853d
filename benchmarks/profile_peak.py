"""Profiling's own peak against the memory budget, measured by a live-storage count that is not the
library's (weak references to every storage an op makes, `tests/test_recompute_probe._LivePeak`), around
the whole `auto_checkpoint` call and the first steps, beside the same numbers for the plan's steps:

- `lm`: a causal LM of 8 attention-heavy blocks (d 32, one head) at batch 4 x 1,000 tokens, 120 MiB;
- `llama`: HF Llama from config (8 layers, hidden 128, 4 heads, attention dropout 0.1) at batch (1, 2048),
  a budget 10 % above the `full` plan's measured peak; losses compared with training without the library;
- `grow`: the causal LM of `lm` at batch 4 over lengths that grow from 100 to 1,000 tokens (each new length
  profiled when it comes, inside the measured step), 120 MiB;
- `swin`: HF Swin from config (224 px, embed 48, depths 2/2/6/2) at batch 8 with `blocks=None`, a budget of
  0.53 x the unplanned step's measured peak.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_peak.py [--cases lm llama grow swin]

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
        f"{plan.predicted_peak_bytes / budget:5.3f}x | steps {max(steps) / budget:5.3f}x budget (max of {len(steps)})"
    )
    handle.remove()
    return losses


def grow() -> None:
    """The LM over growing lengths: every step measured with its `handle.step` (a new length is profiled there)."""
    torch.manual_seed(0)
    model, budget = _LM(), 120 * MiB
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths = [100 + 900 * i // 19 for i in range(20)]
    batches = [torch.randint(0, 96, (4, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
    held = sum(p.untyped_storage().nbytes() for p in model.parameters())
    handle, worst, library_s, total_s = None, 0.0, 0.0, time.perf_counter()
    for batch in batches:
        gc.collect()
        state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        with _LivePeak() as seen:
            start = time.perf_counter()
            if handle is None:
                handle = auto_checkpoint(model, budget, example_batch=batch, step_fn=model, optimizer=opt, blocks="blocks",
                                         verbose=False, info=lambda line: None)
            handle.step(batch)
            library_s += time.perf_counter() - start
            model(batch).backward()
            opt.step()
            opt.zero_grad()
        worst = max(worst, (seen.peak + held + state + batch.nbytes) / budget)
    total_s = time.perf_counter() - total_s
    print(f"grow   budget {budget / MiB:7.1f} MiB | {len(lengths)} lengths 100..1000, {handle.engine.profile_runs} "
          f"profiles | worst step (its profiling included) {worst:4.2f}x budget | library {library_s:5.1f} s of "
          f"{total_s:5.1f} s ({100 * library_s / total_s:.0f} %)")
    handle.remove()


def swin() -> None:
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)

    def build():
        torch.manual_seed(0)
        cfg = SwinConfig(image_size=224, embed_dim=48, depths=[2, 2, 6, 2], num_labels=10)
        return SwinForImageClassification(cfg).train()

    g = torch.Generator().manual_seed(0)
    batches = [{"pixel_values": torch.randn(8, 3, 224, 224, generator=g), "labels": torch.randint(0, 10, (8,), generator=g)}
               for _ in range(2)]
    plain = build()
    _, ref_peaks = _steps(plain, lambda b: plain(**b).loss, batches)
    held = _held(plain, batches[0])
    budget = int(0.53 * (max(ref_peaks) + held))
    model = build()
    run("swin", model, lambda b: model(**b).loss, batches, budget, None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["lm", "llama", "grow", "swin"], choices=["lm", "llama", "grow", "swin"])
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
    if "grow" in args.cases:
        grow()
    if "swin" in args.cases:
        swin()


if __name__ == "__main__":
    main()
