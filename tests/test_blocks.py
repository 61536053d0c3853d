"""Block resolution: containers, auto-detection, lists of paths and globs."""

from __future__ import annotations

import pytest
import torch
from models import TinyChain, TinyCNN, tokens_batch

from lightning_ckpt.profiling.blocks import candidate_containers, resolve_blocks
from lightning_ckpt.profiling.profiler import probe_step


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


def test_blocks_listed_out_of_call_order_are_refused():
    model = TinyChain(n_blocks=3)
    _, names, mods = resolve_blocks(model, ["blocks.1", "blocks.0", "blocks.2"])

    def step(batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    with pytest.raises(ValueError, match=r"block 'blocks.0' ran when block 'blocks.1' was expected"):
        probe_step(model, mods, step, tokens_batch(), names, timing=False)
