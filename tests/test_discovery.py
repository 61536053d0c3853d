"""`discover_chain` builds chains of block calls in the order they run, at every level of the module
tree: a layer shared by all layers (ALBERT) or one encoder run on two views gives one block per call,
calls with autograd off give none, a wrapper that calls a later stack's embedding first (Llava) does not
reorder the chain, stages and the blocks inside them (Swin, ConvNeXt, a U-Net) are both offered, and a
chain that saves nothing (Reformer) is offered with its 0 B. Then `choose_chain` and
`describe_nothing_saved` on hand-made candidates. HF models are built from tiny configs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from level_models import tiny_convnext, tiny_funnel, tiny_llava, tiny_reformer, tiny_swin, tiny_unet_conditional
from models import MLPBlock
from storage_oracle import LiveStorages
from torch import nn

from lightning_ckpt import InfeasibleBudgetError
from lightning_ckpt.engine.chain_levels import ChainScore, choose_chain, describe_nothing_saved
from lightning_ckpt.profiling.structure.call_sequence import record_calls
from lightning_ckpt.profiling.structure.discovery import ChainChoice, discover_chain
from lightning_ckpt.profiling.passes.profile_budget import SliceRoom


def _by_size(choice: ChainChoice) -> dict[int, ChainChoice]:
    return {len(c.names): c for c in choice.candidates}


# ----------------------------------------------------------------------------- plain torch


class _Encoder(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class _TwoViews(nn.Module):
    """One encoder run on two views of the batch, SimCLR style."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.encoder = _Encoder(d)
        self.projector = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))

    def forward(self, x):
        z1 = F.normalize(self.projector(self.encoder(x).mean(1)), dim=-1)
        z2 = F.normalize(self.projector(self.encoder(x.flip(1)).mean(1)), dim=-1)
        return -(z1 * z2).sum(-1).mean()


def test_an_encoder_run_on_two_views_gives_each_block_twice():
    torch.manual_seed(0)
    model = _TwoViews()
    choice = discover_chain(model, model, torch.randn(4, 8, 16))
    blocks = [f"encoder.blocks.{i}" for i in range(3)]
    # the stem, norm and projector run between the views too, but also before or after the chain: a chain
    # holds every call of its modules, so they stay out
    assert choice.names == (*(f"{b}#0" for b in blocks), *(f"{b}#1" for b in blocks))
    assert choice.call_index == (0, 0, 0, 1, 1, 1)
    assert all(choice.modules[i] is choice.modules[i + 3] is model.encoder.blocks[i] for i in range(3))
    assert choice.level == "the children of encoder.blocks" and choice.alternatives == ()
    assert [n for n, _ in choice.left_out] == [
        "encoder.norm#0", "projector#0", "encoder.stem#1", "encoder.norm#1", "projector#1", "(the rest of the step)"
    ]  # the first view's stem saves only the batch, which is not counted
    assert choice.covered_bytes == sum(choice.entry_saved_bytes) and 0.8 * choice.step_bytes < choice.covered_bytes
    assert "6 blocks from encoder.blocks.0#0 to encoder.blocks.2#1 (calls of 3 modules)" in str(choice)


def test_the_chain_is_read_within_the_room_on_one_sample_when_two_do_not_fit_or_the_batch_is_refused():
    """The forward that reads the chain holds no more than the room profiling has (a live-storage count of the
    test's own, `storage_oracle`): between what one sample and two need, it reads one; below one, it refuses."""
    torch.manual_seed(0)
    model = _Encoder(d=16)

    def loss(x):
        return model(x).square().mean()

    batch = torch.randn(4, 256, 16)
    outside = sum(p.untyped_storage().nbytes() for p in model.parameters()) + batch.untyped_storage().nbytes()

    def reading(n: int) -> int:
        with LiveStorages() as mode:
            record_calls(model, loss, batch[:n].clone())
        return mode.peak

    one, two = reading(1), reading(2)
    for budget in (outside + (one + two) // 2, outside + one // 2):
        with LiveStorages() as mode:
            mode.count([*model.parameters(), batch])
            if budget - outside > one:
                choice = discover_chain(model, loss, batch, room=SliceRoom(budget, outside))
                assert choice.names == tuple(f"blocks.{i}" for i in range(3))
            else:
                with pytest.raises(InfeasibleBudgetError, match=r"a pass on 1 sample\(s\) reading which blocks there are "
                                   r"\(blocks=None: a forward with nothing saved for backward.* at least "):
                    discover_chain(model, loss, batch, room=SliceRoom(budget, outside))
        assert mode.peak <= budget, (mode.peak, budget, one, two)


class _WithTarget(nn.Module):
    """A block also run with autograd off (a target computed on the side), between the chain's calls."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.blocks[0](self.stem(x))
        with torch.no_grad():
            target = self.blocks[1](h).mean()
        h = self.blocks[2](self.blocks[1](h))
        return (self.head(h).mean() - target) ** 2


def test_calls_with_autograd_off_are_not_blocks():
    torch.manual_seed(0)
    model = _WithTarget()
    batch = torch.randn(4, 8, 16)
    choice = discover_chain(model, model, batch)
    assert choice.names == ("blocks.0", "blocks.1", "blocks.2") and choice.call_index == (0, 0, 0)
    assert choice.modules[1] is model.blocks[1] and choice.grad_off_calls == 0
    seq = record_calls(model, model, batch[:2])
    ones = [c for c in seq.calls if c.module is model.blocks[1]]
    assert [(c.grad_enabled, c.name, c.saved_bytes > 0) for c in ones] == [(False, "blocks.1#nograd0", False), (True, "blocks.1", True)]


# ----------------------------------------------------------------------------- HF models


def test_albert_shared_layer_gives_one_block_per_layer():
    import transformers

    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=50, embedding_size=16, hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=32
    )
    model = transformers.AlbertModel(config).train()
    choice = discover_chain(model, lambda b: model(input_ids=b).last_hidden_state.sum(), torch.randint(0, 50, (4, 8)))
    assert choice.names == tuple(f"encoder.albert_layer_groups.0#{k}" for k in range(6))
    assert choice.call_index == tuple(range(6)) and all(m is model.encoder.albert_layer_groups[0] for m in choice.modules)
    assert choice.alternatives == ()  # its one layer inside each group call is the same chain, one level in
    assert 0.9 * choice.step_bytes < choice.covered_bytes < choice.step_bytes


def test_swin_and_convnext_offer_the_stages_and_the_blocks_inside():
    swin, _, _ = tiny_swin()
    choice = discover_chain(swin, lambda b: swin(pixel_values=b).logits.sum(), torch.randn(4, 3, 32, 32))
    stages = [f"swin.encoder.layers.{i}" for i in range(4)]
    inner = [f"{s}.{x}" for s in stages for x in ("blocks.0", "blocks.1", "downsample")][:-1]  # the last stage: none
    assert choice.names == tuple(inner) and choice.level == "the children of swin.encoder.layers.*.blocks"
    assert [a.names for a in choice.alternatives] == [tuple(stages)]
    assert choice.alternatives[0].level == "the children of swin.encoder.layers"
    assert choice.alternatives[0].covered_bytes == choice.covered_bytes > 0.95 * choice.step_bytes
    assert choice.largest_entry_bytes < choice.alternatives[0].largest_entry_bytes
    assert choice.to_dict()["alternatives"][0]["names"] == stages and "alternatives" not in choice.alternatives[0].to_dict()
    assert str(choice).endswith("Also found: the children of swin.encoder.layers (4 blocks, swin.encoder.layers.0..swin.encoder.layers.3, 98.1%).")

    convnext, _, _ = tiny_convnext()
    choice = discover_chain(convnext, lambda b: convnext(pixel_values=b).logits.sum(), torch.randn(4, 3, 32, 32))
    stages = [f"convnext.encoder.stages.{i}" for i in range(4)]
    assert choice.names[:3] == (f"{stages[0]}.layers.0", f"{stages[0]}.layers.1", f"{stages[1]}.downsampling_layer.0")
    assert len(choice.names) == 14 and [a.names for a in choice.alternatives] == [tuple(stages)]
    assert choice.alternatives[0].covered_bytes == choice.covered_bytes > 0.95 * choice.step_bytes


def test_funnel_covers_the_encoder_blocks_and_the_decoder():
    model, _, _ = tiny_funnel()
    choice = discover_chain(model, lambda b: model(input_ids=b).last_hidden_state.sum(), torch.randint(0, 50, (4, 8)))
    assert choice.names == ("encoder.blocks.0.0", "encoder.blocks.1.0", "decoder.layers.0", "decoder.layers.1")
    assert choice.covered_bytes > 0.9 * choice.step_bytes


def test_llava_runs_the_vision_layers_then_the_language_layers():
    model, loss, make_batch = tiny_llava()
    batch = make_batch(4, 0)
    choice = discover_chain(model, loss, batch)
    vis, lang = "model.vision_tower.encoder.layers", "model.language_model.layers"
    assert choice.names[:2] == (f"{vis}.0", f"{vis}.1") and choice.names[-2:] == (f"{lang}.0", f"{lang}.1")
    assert "model.multi_modal_projector" in choice.names
    assert not any("embed_tokens" in n or "rotary_emb" in n for n in choice.names)
    # the embedding of the language model runs first, the rotary embedding between projector and layers
    order = [c.path for c in record_calls(model, loss, batch).calls]
    assert order.index("model.language_model.embed_tokens") < order.index(f"{vis}.0")
    assert order.index("model.multi_modal_projector") < order.index("model.language_model.rotary_emb") < order.index(f"{lang}.0")
    assert 0.8 * choice.step_bytes < choice.covered_bytes < 0.95 * choice.step_bytes  # the loss and lm_head are left out


def test_unet_offers_its_top_blocks_and_their_resnets_and_attentions():
    model, _, make_batch = tiny_unet_conditional()
    batch = make_batch(4, 0)
    choice = discover_chain(model, lambda b: model(b[0], b[1], encoder_hidden_states=b[2]).sample.sum(), batch)
    found = _by_size(choice)
    assert found[5].names == ("down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1")
    assert found[14].names == (
        "down_blocks.0.resnets.0", "down_blocks.0.attentions.0", "down_blocks.0.downsamplers.0", "down_blocks.1.resnets.0",
        "mid_block.resnets.0", "mid_block.attentions.0", "mid_block.resnets.1",
        "up_blocks.0.resnets.0", "up_blocks.0.resnets.1", "up_blocks.0.upsamplers.0",
        "up_blocks.1.resnets.0", "up_blocks.1.attentions.0", "up_blocks.1.resnets.1", "up_blocks.1.attentions.1",
    )
    assert found[14].level == (
        "the children of down_blocks.*.{resnets,attentions,downsamplers}, mid_block.{resnets,attentions}, "
        "up_blocks.*.{resnets,upsamplers,attentions}"
    )
    assert found[5].covered_bytes == found[14].covered_bytes > 0.95 * choice.step_bytes
    # the default: the smallest largest block among the chains within 2 % of the step's bytes of the best
    near = [c for c in choice.candidates if c.covered_bytes >= found[5].covered_bytes - 0.02 * c.step_bytes]
    assert choice.largest_entry_bytes == min(c.largest_entry_bytes for c in near) < found[14].largest_entry_bytes
    assert all(c.alternatives == () for c in choice.alternatives)


def test_reformer_layers_save_nothing_and_are_offered_with_their_0_bytes():
    model, loss, make_batch = tiny_reformer()
    choice = discover_chain(model, loss, make_batch(4, 0))
    assert choice.names == ("reformer.encoder.layers.0", "reformer.encoder.layers.1")
    assert choice.covered_bytes == 0 < choice.step_bytes and choice.grad_off_calls == 2
    text = describe_nothing_saved(choice)
    assert text.startswith("blocks=None: the chosen blocks, the children of reformer.encoder.layers (2 blocks")
    assert "hold 0 B of the" in text and "autograd off" in text and "cannot lower memory" in text


# ----------------------------------------------------------------------------- choosing among them


def _candidate(level: str, n: int, covered: int = 100, step: int = 200, **kw) -> ChainChoice:
    blocks = tuple(nn.Identity() for _ in range(n))
    return ChainChoice(
        names=tuple(f"b{i}" for i in range(n)), modules=blocks, covered_bytes=covered, step_bytes=step,
        left_out=(("head", step - covered),) if step > covered else (), probe_batch_size=2, level=level,
        call_index=(0,) * n, entry_saved_bytes=(covered // n,) * n, **kw,
    )


def test_choose_chain_takes_the_least_recompute_that_fits():
    stages, blocks, layers = _candidate("the 4 stages", 4), _candidate("the blocks", 11), _candidate("the layers", 30)
    scores = [ChainScore(False, 0.0, 32), ChainScore(True, 1.2e-3, 32), ChainScore(True, 2.5e-3, 32)]
    index, line = choose_chain([stages, blocks, layers], scores)
    assert index == 1 and "\n" not in line
    assert line.startswith("blocks=None: planning over the blocks (11 blocks, b0..b10), which recomputes 1.2 ms per step")
    assert "the 4 stages (4 blocks, b0..b3) cannot fit batch 32" in line
    assert "the layers (30 blocks, b0..b29) recomputes 2.5 ms per step at batch 32" in line
    # ties: the first; FLOPs are said as such
    flops = [ChainScore(True, 3e9, 32, "flop"), ChainScore(True, 3e9, 32, "flop")]
    index, line = choose_chain([blocks, layers], flops)
    assert index == 0 and "recomputes 3 GFLOP per step" in line


def test_choose_chain_can_take_the_largest_batch():
    a, b, c = _candidate("a", 2), _candidate("b", 3), _candidate("c", 4)
    scores = [ChainScore(True, 1.0, 48), ChainScore(True, 3.0, 64), ChainScore(True, 2.0, 64)]
    assert choose_chain([a, b, c], scores, maximize_batch=True)[0] == 2
    assert choose_chain([a, b, c], scores)[0] == 0
    with pytest.raises(ValueError, match=r"none of the 2 candidate chains fits the memory budget: a \(2 blocks"):
        choose_chain([a, b], [ChainScore(False, 0.0, 8), ChainScore(False, 0.0, 8)])
    with pytest.raises(ValueError, match="got 2 candidate chains and 1 scores"):
        choose_chain([a, b], scores[:1])


def test_describe_nothing_saved():
    assert describe_nothing_saved(_candidate("the layers", 2)) is None
    nothing = _candidate("the layers", 2, covered=0, step=3 * 2**20)
    text = describe_nothing_saved(nothing)
    assert text.startswith("blocks=None: the chosen blocks, the layers (2 blocks, b0..b1), hold 0 B of the 3.0 MiB")
    assert "cannot lower memory; name blocks=[...] among the modules that do save (the most: head, 3.0 MiB)" in text
    with_other = _candidate("the layers", 2, covered=0, alternatives=(_candidate("the blocks", 5, covered=50),))
    assert "plan over the blocks (5 blocks, b0..b4), which holds 50 B, instead" in describe_nothing_saved(with_other)
    assert "saves nothing for backward" in describe_nothing_saved(_candidate("x", 2, covered=0, step=0))
