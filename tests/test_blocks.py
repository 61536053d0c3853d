"""Block resolution: containers, auto-detection, lists of paths and globs."""

from __future__ import annotations

import pytest
import torch
from models import TinyChain, TinyCNN, tokens_batch

from lightning_ckpt.profiling.structure.block_calls import call_chain
from lightning_ckpt.profiling.structure.blocks import candidate_containers, resolve_blocks
from lightning_ckpt.profiling.passes.profiler import probe_step


def test_auto_detects_largest_container():
    model = TinyChain(n_blocks=5)
    path, names, mods = resolve_blocks(model, None)
    assert path == "blocks" and names == [f"blocks.{i}" for i in range(5)] and mods == list(model.blocks)
    assert ("blocks", 5) in candidate_containers(model)


def test_list_of_paths_and_globs_in_order():
    model = TinyCNN(n_blocks=3)
    _, names, mods = resolve_blocks(model, ["stem", "blocks.*", "head"])
    assert names == ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert mods[0] is model.stem and mods[-1] is model.head


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        (["stem", "nope.*"], r"blocks entry 'nope.\*' matches no submodule of TinyCNN; its top-level modules are 'stem', 'blocks', 'head'"),
        (["blocks", "blocks.0"], r"blocks names both 'blocks' and its submodule 'blocks.0'; blocks must not nest"),
        (["blocks.0", "blocks.*"], r"module 'blocks.0' is named twice"),
        ([], r"blocks=\[\] names no modules"),
        ("missing", r"blocks='missing' is not a submodule of TinyCNN; containers of repeated blocks found: 'blocks' \(3 blocks\)"),
    ],
)
def test_bad_block_specs(blocks, match):
    with pytest.raises(ValueError, match=match):
        resolve_blocks(TinyCNN(n_blocks=3), blocks)


def test_blocks_listed_out_of_call_order_are_refused_by_the_probe_and_ordered_by_call_chain():
    model = TinyChain(n_blocks=3)
    _, names, mods = resolve_blocks(model, ["blocks.1", "blocks.0", "blocks.2"])

    def step(batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    with pytest.raises(ValueError, match=r"block call 'blocks.0' ran when 'blocks.1' was expected"):
        probe_step(model, mods, step, tokens_batch(), names, timing=False)
    # the front ends read the chain of calls off the step first: in call order
    order, call_names_ = call_chain(model, mods, names, step, tokens_batch())
    assert call_names_ == ["blocks.0", "blocks.1", "blocks.2"] and order == list(model.blocks)


def _tiny_bert_classifier() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
    )

    class Lit(torch.nn.Module):  # a LightningModule holds the HF model as `self.model`
        def __init__(self) -> None:
            super().__init__()
            self.model = BertForSequenceClassification(config)

    return Lit()


def test_string_naming_one_block_says_to_use_a_list_or_the_container():
    model = _tiny_bert_classifier()
    match = (
        r"blocks='model.bert.encoder.layer.0' names one BertLayer, whose children are of different classes "
        r"\(BertAttention, BertIntermediate, BertOutput\): a string names the container of the blocks .* "
        r"Write blocks=\['model.bert.encoder.layer.0'\] \(a one-element list\) to checkpoint that module alone, "
        r"or blocks='model.bert.encoder.layer' to plan over it and its siblings"
    )
    with pytest.raises(ValueError, match=match):
        resolve_blocks(model, "model.bert.encoder.layer.0")
    _, names, mods = resolve_blocks(model, ["model.bert.encoder.layer.0"])
    assert names == ["model.bert.encoder.layer.0"] and mods == [model.model.bert.encoder.layer[0]]
    path, names, _ = resolve_blocks(model, "model.bert.encoder.layer")
    assert path == "model.bert.encoder.layer" and names == ["model.bert.encoder.layer.0", "model.bert.encoder.layer.1"]


def test_string_naming_one_block_outside_a_container_lists_the_containers():
    with pytest.raises(
        ValueError,
        match=r"blocks='model.bert' names one BertModel, .*\(BertEmbeddings, BertEncoder, BertPooler\).* or the path of "
        r"the container of the blocks, one of 'model.bert.encoder.layer' \(2 blocks\)",
    ):
        resolve_blocks(_tiny_bert_classifier(), "model.bert")


def test_a_module_whose_children_share_a_class_is_a_container():
    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack = Stack()

    path, names, _ = resolve_blocks(Net(), "stack")
    assert path == "stack" and names == ["stack.first", "stack.second"]
    compiled = torch.nn.Module()
    compiled.net = torch.compile(Net())  # the blocks of a compiled model are found through its wrapper
    assert resolve_blocks(compiled, "net.stack")[1] == ["net.stack.first", "net.stack.second"]


# ----------------------------------------------------------------------------- blocks found from the bytes


class _Mid(torch.nn.Module):
    def __init__(self, layers: torch.nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x


class _UNetLike(torch.nn.Module):
    """A stem, two lists of blocks with a middle module between them, a head; the middle module
    holds a list of its own (as a U-Net's mid block holds its resnets) and stays one block."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        from models import MLPBlock

        self.stem = torch.nn.Linear(d, d)
        self.down = torch.nn.ModuleList(MLPBlock(d) for _ in range(2))
        self.mid = _Mid(torch.nn.ModuleList(MLPBlock(d) for _ in range(2)))
        self.up = torch.nn.ModuleList(MLPBlock(d) for _ in range(3))
        self.head = torch.nn.Linear(d, 2)

    def forward(self, x):
        x = self.stem(x)
        for m in self.down:
            x = m(x)
        x = self.mid(x)
        for m in self.up:
            x = m(x)
        return self.head(x).mean()


def test_blocks_none_with_a_step_follows_the_bytes_across_containers():
    from lightning_ckpt.profiling.structure.discovery import discover_chain

    torch.manual_seed(0)
    model = _UNetLike()
    found = discover_chain(model, lambda b: model(b), torch.randn(4, 8, 16))
    # the default: the mid block's two blocks, one level in (its largest block is smaller)
    assert found.names == ("down.0", "down.1", "mid.layers.0", "mid.layers.1", "up.0", "up.1", "up.2")
    assert len(found.alternatives) == 1
    choice = found.alternatives[0]
    assert choice.names == ("down.0", "down.1", "mid", "up.0", "up.1", "up.2")
    assert choice.modules[2] is model.mid and choice.probe_batch_size == 2
    assert [n for n, _ in choice.left_out] == ["head"] and choice.covered_bytes < choice.step_bytes
    assert choice.covered_bytes == found.covered_bytes
    assert str(choice).startswith("blocks=None: chose 6 blocks from down.0 to up.2, which save ")
    # without a step, the largest container alone (the old rule)
    assert resolve_blocks(model, None)[1] == ["up.0", "up.1", "up.2"]
    # a chain with nothing else: the same as before
    chain = TinyChain(n_blocks=3)
    assert discover_chain(chain, lambda b: chain(b[0]).sum(), tokens_batch()).names == ("blocks.0", "blocks.1", "blocks.2")


def test_blocks_none_needs_a_list_of_modules():
    from lightning_ckpt.profiling.structure.discovery import discover_chain

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="has no nn.ModuleList"):
        discover_chain(net, lambda b: net(b).sum(), torch.randn(4, 4))
