"""HF transformers models as the benchmarks build them: random weights from a config (no
download), one training batch, the chain of blocks and the loss.

Shared by `plans.py`, `recompute_check.py`, `step_cost.py` and `peers.py`, so they measure the
same models (`quick` gives smaller ones for smoke runs).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB = 96


def _tokens(batch_size: int, seq: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch_size, seq), generator=torch.Generator().manual_seed(0))


def bert_example(quick: bool) -> tuple[torch.nn.Module, Any, int, str, Callable[[Any], torch.Tensor], str]:
    """(model, batch, batch size, chain, loss, name) of BERT for sequence classification: 48 layers,
    hidden 64, 2 heads, dropout 0.1, batch 16 x 128 tokens, transformers' default attention (SDPA)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    layers, hidden, batch_size, seq = (12, 32, 8, 64) if quick else (48, 64, 16, 128)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=512, num_labels=3,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    model = BertForSequenceClassification(config)
    ids = _tokens(batch_size, seq)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[:, 0] % 3}
    name = f"hf-bert ({layers} layers, hidden {hidden}, batch {batch_size} x {seq})"
    return model, batch, batch_size, "bert.encoder.layer", lambda b: model(**b).loss, name


def llama_example(
    quick: bool, bf16: bool = True
) -> tuple[torch.nn.Module, Any, int, str, Callable[[Any], torch.Tensor], str]:
    """(model, batch, batch size, chain, loss, name) of Llama for causal LM, its step under
    `torch.autocast("cpu", torch.bfloat16)` as Lightning's `bf16-mixed` runs it on a CPU (fp32,
    Lightning's default precision, with `bf16=False`): 16 layers, hidden 128, 4 heads, batch 8 x
    128 tokens, SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    layers, hidden, batch_size, seq = (6, 64, 4, 64) if quick else (16, 128, 8, 128)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, use_cache=False,
    )
    model = LlamaForCausalLM(config)
    ids = _tokens(batch_size, seq)

    def loss_fn(b):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(**b).loss

    name = f"hf-llama {'bf16' if bf16 else 'fp32'} ({layers} layers, hidden {hidden}, batch {batch_size} x {seq})"
    return model, {"input_ids": ids, "labels": ids}, batch_size, "model.layers", loss_fn, name


def swin_example(quick: bool) -> tuple[torch.nn.Module, Any, int, None, Callable[[Any], torch.Tensor], str]:
    """(model, batch, batch size, chain, loss, name) of Swin for image classification, fp32: 224 px,
    embed 48, depths 2/2/6/2 (blocks inside four stages, a hierarchy of modules), batch 8; the chain
    is None (`blocks=None`: the library finds it)."""
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    # quick: windows of 4 tile the 32/16/8/4 patches of each stage (a window larger than a stage fails in SDPA)
    image, embed, depths, window, batch_size = (128, 24, [2, 2, 2, 2], 4, 4) if quick else (224, 48, [2, 2, 6, 2], 7, 8)
    config = SwinConfig(image_size=image, embed_dim=embed, depths=depths, window_size=window, num_labels=10)
    model = SwinForImageClassification(config)
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(batch_size, 3, image, image, generator=g),
             "labels": torch.randint(0, 10, (batch_size,), generator=g)}
    name = f"hf-swin fp32 ({image} px, embed {embed}, depths {'/'.join(map(str, depths))}, batch {batch_size})"
    return model, batch, batch_size, None, lambda b: model(**b).loss, name
