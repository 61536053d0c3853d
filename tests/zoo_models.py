"""Models written outside this project, built from tiny configs (random weights, no downloads), each
with the chain to plan over, a batch maker and a loss: HF T5, BERT, GPT-NeoX, a peft-LoRA Llama, ViT,
ALBERT (one layer run at every depth), Swin and ConvNeXt (blocks inside stages), a diffusers UNet2DModel,
a MONAI ResNet, and a two-view contrastive encoder written here (every block runs twice a step). Every library default is kept unless a size is set here
(T5, Llama and GPT-NeoX keep `use_cache=True`, as their configs ship). `ZOO` names a builder per model.

    entry = ZOO["t5"]()
    names, blocks = entry.blocks()
    entry.loss(entry.batch(4, seed=0)).backward()
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96


@dataclass
class ZooModel:
    """One model: `chain` as `resolve_blocks` takes it, `make_batch(batch_size, seed)` and
    `loss_fn(model, batch)` (a scalar training loss)."""

    name: str
    model: nn.Module
    chain: str | Sequence[str]
    make_batch: Callable[[int, int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]

    def batch(self, batch_size: int = 4, seed: int = 0) -> Any:
        return self.make_batch(batch_size, seed)

    def loss(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)

    def blocks(self) -> tuple[list[str], list[nn.Module]]:
        """(names, modules) of the chain, in call order."""
        from lightning_ckpt import resolve_blocks

        _, names, blocks = resolve_blocks(self.model, self.chain if isinstance(self.chain, str) else list(self.chain))
        return list(names), list(blocks)


def _tokens(batch_size: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch_size, seq), generator=g)


def _hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def t5(layers: int = 3, d_model: int = 32, seq: int = 16, dropout: float = 0.1, **config) -> ZooModel:
    """`T5ForConditionalGeneration`; the chain is the decoder's blocks (`encoder.block` is the other chain)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=layers, num_heads=2,
        dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **config,
    )
    model = T5ForConditionalGeneration(cfg)

    def make_batch(batch_size: int, seed: int) -> dict:
        ids = _tokens(batch_size, seq, seed)
        return {"input_ids": ids, "labels": ids.flip(1)}

    return ZooModel("t5", model, "decoder.block", make_batch, _hf_loss)


def bert(layers: int = 4, hidden: int = 32, seq: int = 16, dropout: float = 0.1, **config) -> ZooModel:
    """`BertForSequenceClassification` (3 labels)."""
    from hf_models import tiny_bert

    model = tiny_bert(layers=layers, hidden=hidden, dropout=dropout, **config)

    def make_batch(batch_size: int, seed: int) -> dict:
        ids = _tokens(batch_size, seq, seed)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[:, 0] % 3}

    return ZooModel("bert", model, "bert.encoder.layer", make_batch, _hf_loss)


def llama(layers: int = 4, hidden: int = 32, seq: int = 16, **config) -> ZooModel:
    """`LlamaForCausalLM` as its config ships (`use_cache=True`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager", **config,
    )
    return ZooModel("llama", LlamaForCausalLM(cfg), "model.layers", _causal_batch(seq), _hf_loss)


def gpt_neox(layers: int = 4, hidden: int = 32, seq: int = 16, **config) -> ZooModel:
    """`GPTNeoXForCausalLM` as its config ships: `use_cache=True` with `is_decoder=False`."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=256, attn_implementation="eager", **config,
    )
    return ZooModel("gpt_neox", GPTNeoXForCausalLM(cfg), "gpt_neox.layers", _causal_batch(seq), _hf_loss)


def lora_llama(
    layers: int = 4, hidden: int = 32, seq: int = 16, rank: int = 4, lora_dropout: float = 0.1, **config
) -> ZooModel:
    """`llama` wrapped by peft's LoRA on the attention projections (the base weights frozen)."""
    from peft import LoraConfig, get_peft_model

    base = llama(layers, hidden, seq, **config)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=lora_dropout, target_modules=["q_proj", "v_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft reads `is_gradient_checkpointing`, renamed in transformers 5
        model = get_peft_model(base.model, lora)
    return ZooModel("lora_llama", model, "base_model.model.model.layers", base.make_batch, _hf_loss)


def _causal_batch(seq: int) -> Callable[[int, int], dict]:
    def make_batch(batch_size: int, seed: int) -> dict:
        ids = _tokens(batch_size, seq, seed)
        return {"input_ids": ids, "labels": ids}

    return make_batch


def unet(sample: int = 32, channels: tuple[int, ...] = (32, 64), **config) -> ZooModel:
    """diffusers `UNet2DModel`, trained to predict the noise; the chain runs down, mid and up blocks
    (the down blocks' outputs reach the up blocks through skip connections, around the chain). Its blocks
    are called with `hidden_states=` as a keyword, so `apply` takes one block per segment only."""
    from diffusers import UNet2DModel

    model = UNet2DModel(
        sample_size=sample, in_channels=3, out_channels=3, block_out_channels=channels, layers_per_block=1,
        down_block_types=("DownBlock2D",) + ("AttnDownBlock2D",) * (len(channels) - 1),
        up_block_types=("AttnUpBlock2D",) * (len(channels) - 1) + ("UpBlock2D",), **config,
    )
    n = len(channels)

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        noisy = torch.randn(batch_size, 3, sample, sample, generator=g)
        noise = torch.randn(batch_size, 3, sample, sample, generator=g)
        return noisy, torch.randint(0, 1000, (batch_size,), generator=g), noise

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        noisy, timesteps, noise = batch
        return F.mse_loss(model(noisy, timesteps).sample, noise)

    chain = [f"down_blocks.{i}" for i in range(n)] + ["mid_block"] + [f"up_blocks.{i}" for i in range(n)]
    return ZooModel("unet", model, chain, make_batch, loss_fn)


def vit(layers: int = 4, hidden: int = 32, image: int = 32, patch: int = 8, classify: bool = True,
        dropout: float = 0.1, **config) -> ZooModel:
    """HF `ViTForImageClassification` (3 labels), or `ViTModel` regressing its last hidden state on a
    random target with `classify=False`; attention and hidden dropout on."""
    from transformers import ViTConfig, ViTForImageClassification, ViTModel

    cfg = ViTConfig(
        image_size=image, patch_size=patch, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=2 * hidden, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, num_labels=3,
        attn_implementation="eager", **config,
    )
    model = ViTForImageClassification(cfg) if classify else ViTModel(cfg, add_pooling_layer=False)

    def make_batch(batch_size: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        pixels = torch.randn(batch_size, 3, image, image, generator=g)
        if not classify:  # one token per patch and the class token
            target = torch.randn(batch_size, (image // patch) ** 2 + 1, hidden, generator=g)
            return {"pixel_values": pixels, "target": target}
        return {"pixel_values": pixels, "labels": torch.randint(0, 3, (batch_size,), generator=g)}

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        if classify:
            return model(**batch).loss
        return F.mse_loss(model(pixel_values=batch["pixel_values"]).last_hidden_state, batch["target"])

    return ZooModel("vit" if classify else "vit_model", model, "vit.layers" if classify else "layers",
                    make_batch, loss_fn)


# conv1, bn1 and maxpool are the stem (its in-place ReLU runs between bn1 and maxpool, outside
# the chain: a block that overwrites its own input cannot be recomputed); avgpool + fc the head.
RESNET_CHAIN = ("conv1", "bn1", "maxpool", "layer1", "layer2", "layer3", "layer4", "fc")


def resnet(image: int = 32, widths: tuple[int, ...] = (16, 32, 64, 128), classes: int = 4) -> ZooModel:
    """MONAI's 2-D basic-block ResNet with BatchNorm; `fc` runs on the pooled, flattened output of
    `layer4` (outside the chain), so a segment cannot end at `fc` from an earlier block."""
    from monai.networks.nets import ResNet

    model = ResNet("basic", [1, 1, 1, 1], list(widths), spatial_dims=2, n_input_channels=3, num_classes=classes)

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, 3, image, image, generator=g), torch.randint(0, classes, (batch_size,), generator=g)

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    return ZooModel("resnet", model, RESNET_CHAIN, make_batch, loss_fn)


def albert(layers: int = 6, hidden: int = 32, seq: int = 16, dropout: float = 0.1, **config) -> ZooModel:
    """`AlbertForMaskedLM`: one layer module run at every depth (`layers` calls per step, each a block)."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=2 * hidden, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        max_position_embeddings=256, **config,
    )
    return ZooModel("albert", AlbertForMaskedLM(cfg), "albert.encoder.albert_layer_groups", _causal_batch(seq), _hf_loss)


def _pixels_and_labels(image: int, classes: int = 3) -> Callable[[int, int], dict]:
    def make_batch(batch_size: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        pixels = torch.randn(batch_size, 3, image, image, generator=g)
        return {"pixel_values": pixels, "labels": torch.randint(0, classes, (batch_size,), generator=g)}

    return make_batch


def swin(image: int = 32, embed: int = 16, depths: tuple[int, ...] = (2, 2, 2, 2), **config) -> ZooModel:
    """`SwinForImageClassification`; the chain is the blocks inside the four stages."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=image, patch_size=2, embed_dim=embed, depths=list(depths), num_heads=[1, 1, 2, 2],
                     window_size=2, num_labels=3, **config)
    return ZooModel("swin", SwinForImageClassification(cfg), ["swin.encoder.layers.*.blocks.*"],
                    _pixels_and_labels(image), _hf_loss)


def convnext(image: int = 32, widths: tuple[int, ...] = (8, 16, 16, 32), **config) -> ZooModel:
    """`ConvNextForImageClassification`; the chain is the layers inside the four stages."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(hidden_sizes=list(widths), depths=[2, 2, 2, 2], num_labels=3, image_size=image, **config)
    return ZooModel("convnext", ConvNextForImageClassification(cfg), ["convnext.encoder.stages.*.layers.*"],
                    _pixels_and_labels(image), _hf_loss)


class TwoViewEncoder(nn.Module):
    """A SimCLR-style step: one encoder of pre-norm MLP blocks on two noisy views of each sample of tokens,
    a contrastive loss between the pooled views (every block runs twice per step)."""

    def __init__(self, layers: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden),
                          nn.Dropout(0.1))
            for _ in range(layers)
        )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return F.normalize(h.mean(1), dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z1, z2 = self.encode(x + 0.1 * torch.randn_like(x)), self.encode(x + 0.1 * torch.randn_like(x))
        return F.cross_entropy(z1 @ z2.T / 0.5, torch.arange(len(x)))


def two_views(layers: int = 4, hidden: int = 32, seq: int = 16) -> ZooModel:
    """`TwoViewEncoder`: each block's two calls are two blocks of the chain."""

    def make_batch(batch_size: int, seed: int) -> torch.Tensor:
        return torch.randn(batch_size, seq, hidden, generator=torch.Generator().manual_seed(seed))

    return ZooModel("two_views", TwoViewEncoder(layers, hidden), "blocks", make_batch, lambda m, b: m(b))


ZOO: dict[str, Callable[..., ZooModel]] = {
    "t5": t5,
    "bert": bert,
    "llama": llama,
    "lora_llama": lora_llama,
    "unet": unet,
    "vit": vit,
    "vit_model": lambda **kw: vit(classify=False, **kw),
    "resnet": resnet,
    "albert": albert,
    "swin": swin,
    "convnext": convnext,
    "two_views": two_views,
}
