"""LayerDrop found in tiny HF models (Wav2Vec2, BART, Whisper) and in plain modules, every layer run
inside `layers_always_run` with the same random draws as outside, settings put back exactly, and the
note for users."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from lightning_ckpt.profiling.structure.layer_skipping import (
    ALWAYS_RUN_PROBABILITY,
    LayerSkipping,
    find_layer_skipping,
    layer_skipping_note,
    layers_always_run,
)

NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def tiny_wav2vec2(dropout: bool = True, **kw):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    if not dropout:
        kw.update(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                  final_dropout=0.0, mask_time_prob=0.0)
    config = Wav2Vec2Config(
        vocab_size=8, hidden_size=16, num_hidden_layers=6, num_attention_heads=2, intermediate_size=16,
        num_feat_extract_layers=2, conv_dim=(8, 8), conv_stride=(4, 4), conv_kernel=(8, 4),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, layerdrop=0.9, **kw,
    )
    return Wav2Vec2ForCTC(config), lambda m: m(torch.randn(2, 320))


def tiny_wav2vec2_with_adapter(dropout: bool = True):
    return tiny_wav2vec2(dropout, add_adapter=True, num_adapter_layers=3, adapter_stride=1, adapter_kernel_size=1)


def tiny_bart(dropout: bool = True):
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=32, d_model=16, encoder_layers=6, decoder_layers=6, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=32,
        encoder_layerdrop=0.9, decoder_layerdrop=0.5, **({} if dropout else NO_DROPOUT),
    )
    return BartForConditionalGeneration(config), lambda m: m(
        input_ids=torch.randint(3, 32, (2, 7)), labels=torch.randint(3, 32, (2, 5))
    )


def tiny_whisper(dropout: bool = True):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=32, num_mel_bins=4, d_model=16, encoder_layers=6, decoder_layers=6, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_source_positions=8,
        max_target_positions=16, encoder_layerdrop=0.9, decoder_layerdrop=0.5, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, **({"dropout": 0.1} if dropout else NO_DROPOUT),
    )
    return WhisperForConditionalGeneration(config), lambda m: m(
        input_features=torch.randn(2, 4, 16), labels=torch.randint(3, 32, (2, 5))
    )


MODELS = [tiny_wav2vec2, tiny_wav2vec2_with_adapter, tiny_bart, tiny_whisper]


def count_layer_calls(model: nn.Module) -> list[int]:
    calls = [0]
    ends = ("encoder.layers", "decoder.layers", "adapter.layers")
    stacks = [m for name, m in model.named_modules() if name.endswith(ends)]
    for layer in (layer for stack in stacks for layer in stack):
        layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    calls.append(sum(len(stack) for stack in stacks))
    return calls


def seeded_forward(model: nn.Module, run, always: bool):
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    if always:
        with layers_always_run(model):
            run(model)
    else:
        run(model)
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def test_find_layer_skipping_reads_wav2vec2_config_and_adapter():
    model, _ = tiny_wav2vec2()
    assert find_layer_skipping(model) == (LayerSkipping("config", "layerdrop", 0.9),)
    model, _ = tiny_wav2vec2_with_adapter()
    assert find_layer_skipping(model) == (
        LayerSkipping("config", "layerdrop", 0.9),
        LayerSkipping("wav2vec2.adapter", "layerdrop", 0.9),
    )


@pytest.mark.parametrize("make", [tiny_bart, tiny_whisper])
def test_find_layer_skipping_lists_the_shared_config_once_and_each_layer_stack(make):
    model, _ = make()
    assert find_layer_skipping(model) == (
        LayerSkipping("config", "encoder_layerdrop", 0.9),
        LayerSkipping("config", "decoder_layerdrop", 0.5),
        LayerSkipping("model.encoder", "layerdrop", 0.9),
        LayerSkipping("model.decoder", "layerdrop", 0.5),
    )


def test_find_layer_skipping_ignores_dropouts_flags_and_zero():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model[0].layer_dropout, model[0].use_layerdrop, model[0].layerdrop = 0.5, True, 0.0
    model[1].config = SimpleNamespace(layerdrop=0, hidden_dropout=0.3, layerdrop_schedule="linear")
    assert find_layer_skipping(model) == ()
    assert layer_skipping_note(()) == ""


def test_find_layer_skipping_covers_spellings_and_plain_configs():
    shared = SimpleNamespace(layer_drop=1, dropout=0.1)
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    model[0].config = model[1][0].config = shared
    model[1].LayerDrop = 0.25
    assert find_layer_skipping(model) == (
        LayerSkipping("0.config", "layer_drop", 1.0),
        LayerSkipping("1", "LayerDrop", 0.25),
    )


@pytest.mark.parametrize("make", MODELS)
def test_layers_always_run_runs_every_layer_in_training(make):
    model, run = make()
    model.train()
    found = find_layer_skipping(model)
    calls = count_layer_calls(model)
    seeded_forward(model, run, always=False)
    assert 0 < calls[0] < calls[1]
    calls[0] = 0
    seeded_forward(model, run, always=True)
    assert calls[0] == calls[1]
    assert find_layer_skipping(model) == found


@pytest.mark.parametrize("make", MODELS)
def test_layers_always_run_keeps_the_random_draws(make):
    """Without dropout the layers draw nothing but their LayerDrop decisions: the same draws, in and out.
    (With dropout on, each layer that runs draws its masks too, so more running layers draw more.)"""
    model, run = make(dropout=False)
    model.train()
    outside, inside = seeded_forward(model, run, always=False), seeded_forward(model, run, always=True)
    assert torch.equal(outside[0], inside[0])
    assert np.array_equal(outside[1][1], inside[1][1]) and outside[1][2] == inside[1][2]
    assert outside[2] == inside[2]


def test_layers_always_run_restores_values_types_and_nests():
    model, _ = tiny_bart()
    model.model.encoder.layerdrop = 1  # an int, as a user may write it (HF configs take only floats)
    found = find_layer_skipping(model)
    with layers_always_run(model) as changed:
        assert changed == found
        assert model.model.encoder.layerdrop == model.config.encoder_layerdrop == ALWAYS_RUN_PROBABILITY
        assert type(model.model.encoder.layerdrop) is float
        assert find_layer_skipping(model) == ()
        with layers_always_run(model) as inner:
            assert inner == ()
        assert model.model.decoder.layerdrop == ALWAYS_RUN_PROBABILITY
    assert find_layer_skipping(model) == found
    assert type(model.model.encoder.layerdrop) is int and model.model.encoder.layerdrop == 1
    with pytest.raises(RuntimeError, match="in the forward"):
        with layers_always_run(model):
            raise RuntimeError("failed in the forward")
    assert find_layer_skipping(model) == found
    assert type(model.model.encoder.layerdrop) is int and model.model.decoder.layerdrop == 0.5


def test_layers_always_run_names_a_setting_it_cannot_change():
    @dataclass(frozen=True)
    class Frozen:
        layerdrop: float = 0.3

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].layerdrop = 0.2
    model[1].config = Frozen()
    with pytest.raises(TypeError, match=r"cannot set Frozen\.layerdrop \(now 0\.3\).*set it to 0\.0 before training"):
        with layers_always_run(model):
            pass
    assert model[0].layerdrop == 0.2


def test_layer_skipping_note_names_each_setting_and_the_way_out():
    model, _ = tiny_bart()
    note = layer_skipping_note(find_layer_skipping(model))
    for name in ("config.encoder_layerdrop=0.9", "config.decoder_layerdrop=0.5", "model.encoder.layerdrop=0.9",
                 "model.decoder.layerdrop=0.5"):
        assert name in note
    assert "each block on its own" in note and "for example model.encoder.layerdrop=0.0" in note
    assert ". " not in note and note.endswith(").")  # one sentence


def test_wav2vec2_with_its_default_layerdrop_trains_within_budget_bit_identically():
    """Wav2Vec2's default `layerdrop=0.1`: profiled with every layer running, planned one block per segment;
    steps that skip layers (seen here) stay bit-identical to training without the library and within budget."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    from models import steps_with_peaks

    from lightning_ckpt import auto_checkpoint, make_plan
    from lightning_ckpt.engine.step_profile import profile_model
    from lightning_ckpt.engine.target_plan import cost_at
    from lightning_ckpt.profiling.memory.static_memory import static_memory

    def build():
        torch.manual_seed(0)
        config = Wav2Vec2Config(
            hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=64, num_feat_extract_layers=2,
            conv_dim=(16, 16), conv_stride=(4, 4), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2, num_labels=3, mask_time_prob=0.0,
        )
        assert config.layerdrop == 0.1  # the library's default, kept
        return Wav2Vec2ForSequenceClassification(config).train()

    g = torch.Generator().manual_seed(0)
    batches = [{"input_values": torch.randn(8, 1600, generator=g), "labels": torch.randint(0, 3, (8,), generator=g)}
               for _ in range(8)]
    blocks = "wav2vec2.encoder.layers"

    def loss(model):
        return lambda batch: model(**batch).loss

    model = build()
    names = [f"{blocks}.{i}" for i in range(6)]
    profile = profile_model(model, list(model.wav2vec2.encoder.layers), loss(model), batches[0], names=names,
                            timing=False)
    cost = cost_at(profile, 8, static_memory(model, [torch.optim.AdamW(model.parameters())]))
    full, none = (make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
    budget = int(full + 0.3 * (none - full))
    plain = build()
    reference, _ = steps_with_peaks(plain, loss(plain), batches)
    model = build()
    runs: list[int] = []  # per training forward, the encoder layers that ran (not the recomputes, not the measuring)
    counting = [False]

    def start(i: int) -> None:
        runs.append(0)
        counting[0] = True

    model.register_forward_hook(lambda m, a, o: counting.__setitem__(0, False))
    for layer in model.wav2vec2.encoder.layers:
        layer.register_forward_pre_hook(lambda m, a: runs.__setitem__(-1, runs[-1] + 1) if counting[0] else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with auto_checkpoint(model, budget, example_batch=batches[0], step_fn=loss(model), optimizer=opt,
                         blocks=blocks, verbose=False, info=lambda m: None) as handle:
        losses, peaks = steps_with_peaks(model, loss(model), batches, handle, opt, between=start)
        plan = handle.plan
    assert len(runs) == len(batches) and min(runs) < 6  # some steps skipped layers
    assert plan.checkpointed and all(a == b for a, b in plan.segments)  # one block per segment
    assert max(peaks) <= budget
    assert all(torch.equal(a, b) for a, b in zip(losses, reference))
