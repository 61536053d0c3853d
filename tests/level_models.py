"""Hierarchical models from tiny configs (random weights, no downloads), each as (model, loss, make_batch):
HF Swin and ConvNeXt (stages of blocks), Funnel (a list of lists), Llava (a CLIP vision tower and a Llama),
diffusers' UNet2DConditionModel (two sizes), and HF Reformer (reversible layers, which save nothing). `make_batch(n, seed)` gives a training batch of `n` samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Built = tuple[nn.Module, Callable[[Any], torch.Tensor], Callable[[int, int], Any]]


def _images(size: int, channels: int = 3) -> Callable[[int, int], torch.Tensor]:
    return lambda n, seed: torch.randn(n, channels, size, size, generator=torch.Generator().manual_seed(seed))


def tiny_swin() -> Built:
    import transformers

    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2, 2, 2], num_heads=[1, 1, 2, 2], window_size=2, num_labels=3
    )).train()
    return model, lambda b: model(pixel_values=b).logits.square().mean(), _images(32)


def tiny_convnext() -> Built:
    import transformers

    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(
        transformers.ConvNextConfig(hidden_sizes=[8, 16, 16, 32], depths=[2, 2, 2, 2], num_labels=3)
    ).train()
    return model, lambda b: model(pixel_values=b).logits.square().mean(), _images(32)


def tiny_funnel() -> Built:
    import transformers

    torch.manual_seed(0)
    config = transformers.FunnelConfig(
        vocab_size=50, block_sizes=[1, 1], d_model=16, n_head=2, d_head=8, d_inner=32, num_decoder_layers=2
    )
    model = transformers.FunnelModel(config).train()

    def batch(n: int, seed: int) -> torch.Tensor:
        return torch.randint(0, 50, (n, 8), generator=torch.Generator().manual_seed(seed))

    return model, lambda b: model(input_ids=b).last_hidden_state.square().mean(), batch


def tiny_llava() -> Built:
    import transformers

    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=8
    )
    text = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2,
    )
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=63,
                                      projector_hidden_act="gelu", vision_feature_layer=-2)
    model = transformers.LlavaForConditionalGeneration(config).train()

    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 60, (n, 12), generator=g)
        ids[:, 1:5] = 63  # 4 patches of 8 x 8 in a 16 x 16 image
        return ids, torch.randn(n, 3, 16, 16, generator=g)

    return model, lambda b: model(input_ids=b[0], pixel_values=b[1], labels=b[0]).loss, batch


def _unet_conditional(px: int, channels: tuple[int, int], layers: int, width: int, groups: int, tokens: int) -> Built:
    """diffusers' conditional U-Net at `px` pixels: `channels` per level, `layers` per block, cross-attention over
    `tokens` states `width` wide."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(
        sample_size=px, in_channels=4, out_channels=4, block_out_channels=channels, layers_per_block=layers,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=width, attention_head_dim=8, norm_num_groups=groups,
    ).train()

    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(n, 4, px, px, generator=g), torch.randint(0, 1000, (n,), generator=g),
                torch.randn(n, tokens, width, generator=g))

    return model, lambda b: model(b[0], b[1], encoder_hidden_states=b[2]).sample.square().mean(), batch


def tiny_unet_conditional() -> Built:
    return _unet_conditional(8, (16, 32), 1, 16, 8, 5)


def small_unet_conditional() -> Built:
    """diffusers' own test configuration of the conditional U-Net (32 px, channels 32/64, two layers per block,
    cross-attention over 32-wide states): each attention's `proj_out` runs on a copy while the module's local
    still holds the transformer block's output."""
    return _unet_conditional(32, (32, 64), 2, 32, 32, 7)


def tiny_reformer() -> Built:
    """Reformer's reversible layers run with autograd off inside their own Function: they save nothing."""
    import transformers

    torch.manual_seed(0)
    config = transformers.ReformerConfig(
        vocab_size=50, hidden_size=16, attention_head_size=8, num_attention_heads=2, feed_forward_size=32,
        attn_layers=["local", "local"], axial_pos_shape=[4, 4], axial_pos_embds_dim=[8, 8], is_decoder=True,
        local_attn_chunk_length=4, max_position_embeddings=16,
    )
    model = transformers.ReformerModelWithLMHead(config).train()

    def batch(n: int, seed: int) -> torch.Tensor:
        return torch.randint(0, 50, (n, 16), generator=torch.Generator().manual_seed(seed))

    return model, lambda b: model(input_ids=b, labels=b).loss, batch


LEVEL_MODELS = {
    "swin": tiny_swin, "convnext": tiny_convnext, "funnel": tiny_funnel, "llava": tiny_llava,
    "unet_conditional": tiny_unet_conditional, "small_unet_conditional": small_unet_conditional, "reformer": tiny_reformer,
}
