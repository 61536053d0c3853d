"""HF models built from config (random weights, no downloads) and data as HF pipelines deliver it:
token ids of varying lengths, padded per batch by `DataCollatorWithPadding` into `BatchEncoding`s."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

VOCAB = 96


def word_tokenizer():
    """A real fast tokenizer over a made-up word vocabulary (`[PAD]` is id 0), built locally."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


class VariableLengthText(Dataset):
    """Samples of `lengths[i // batch_size]` tokens: each batch of a sequential loader has one length."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0, n_labels: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for length in lengths:
            for k in range(batch_size):
                # every batch has one sample of its full length, the others are shorter (padded)
                n = length if k == 0 else int(torch.randint(max(1, length // 2), length + 1, (1,), generator=g))
                ids = torch.randint(2, VOCAB, (n,), generator=g).tolist()
                self.samples.append({"input_ids": ids, "label": int(ids[0] % n_labels)})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        return {"input_ids": s["input_ids"], "attention_mask": [1] * len(s["input_ids"]), "labels": s["label"]}


class PaddedTextData(pl.LightningDataModule):
    """Batches padded to their own longest sample by `transformers.DataCollatorWithPadding`."""

    def __init__(self, lengths: list[int], batch_size: int = 8, seed: int = 0) -> None:
        super().__init__()
        self.lengths, self.batch_size, self.seed = list(lengths), batch_size, seed

    def train_dataloader(self) -> DataLoader:
        from transformers import DataCollatorWithPadding

        ds = VariableLengthText(self.lengths, self.batch_size, self.seed)
        collate = DataCollatorWithPadding(word_tokenizer(), return_tensors="pt")
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, collate_fn=collate)


def tiny_bert(layers: int = 4, hidden: int = 32, dropout: float = 0.1, **kw):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=512, num_labels=3,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, attn_implementation="eager", **kw,
    )
    return BertForSequenceClassification(config)


class LitHF(pl.LightningModule):
    """A HF model that takes the collator's batch as keyword arguments and returns its loss."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.model, self.lr = model, lr
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class StepPeaks(pl.Callback):
    """The tracked peak of every training step, the whole step's tensors (parameters, gradients,
    optimizer state, the batch, activations) as `lightning_ckpt.profiling.memory.step_peak` counts them."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.shapes: list[tuple] = []
        self._ctx = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_ckpt.frontends.lightning.measured_peak import step_peak

        self._ctx = step_peak(trainer, pl_module, batch)
        self._reading = self._ctx.__enter__()
        self.shapes.append(tuple(batch["input_ids"].shape) if "input_ids" in batch else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._ctx.__exit__(None, None, None)
        self.peaks.append(self._reading.peak_bytes)


def tiny_llama(layers: int = 4, hidden: int = 32, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager",
        use_cache=False, **kw,
    )
    return LlamaForCausalLM(config)


class CausalTokens(pl.LightningDataModule):
    """Fixed-length token batches whose labels are the inputs (a causal LM computes the shift)."""

    def __init__(self, batch_size: int = 4, n: int = 64, seq: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, VOCAB, (n, seq), generator=g)

    def train_dataloader(self) -> DataLoader:
        rows = [{"input_ids": r, "labels": r} for r in self.ids]
        return DataLoader(rows, batch_size=self.batch_size, shuffle=False)
