"""The plan table: block names after their common dotted prefix, printed once; never cut."""

from __future__ import annotations

import pytest

from lightning_ckpt.planning.plan import BlockRow, Plan, name_prefix


def _plan(names: list[str], segments=((0, 1),)) -> Plan:
    inside = {i: j for j, (a, b) in enumerate(segments) for i in range(a, b + 1)}
    rows = tuple(
        BlockRow(index=i, name=n, checkpointed=i in inside, segment=inside.get(i, -1), saved_bytes=2**20,
                 input_bytes=2**16, fwd_flops=10**9, fwd_ms=1.0)
        for i, n in enumerate(names)
    )
    return Plan(policy="optimal", batch_size=8, segments=tuple(segments), predicted_peak_bytes=2**30, peak_phase="backward",
                budget_bytes=2**31, static_bytes=2**28, recompute_flops=2 * 10**9, recompute_ms=2.0,
                step_flops=3 * 10**9 * len(names), rows=rows)


@pytest.mark.parametrize(
    ("names", "prefix"),
    [
        (["base_model.model.model.layers.0", "base_model.model.model.layers.1"], "base_model.model.model.layers."),
        (["layers.1", "layers.10", "layers.11"], "layers."),  # whole components, not "layers.1"
        (["encoder.layer.0", "encoder.layer.1", "decoder.block.0"], ""),
        (["stem", "layer1.0", "head"], ""),
        (["encoder", "encoder.layer.0"], ""),  # every name keeps at least its last component
        (["model.layers.0"], "model.layers."),
        ([], ""),
    ],
)
def test_name_prefix_is_whole_shared_components(names, prefix):
    assert name_prefix(names) == prefix


def test_names_print_after_their_prefix_which_is_printed_once():
    names = [f"base_model.model.model.layers.{i}" for i in range(12)]
    text = str(_plan(names, segments=((0, 3), (5, 5))))
    assert "..." not in text and "odel.model" not in text.replace("base_model.model.model.layers.", "")
    assert text.count("base_model.model.model.layers.") == 1
    assert "block names below are under base_model.model.model.layers." in text.splitlines()[1]
    rows = [ln.split() for ln in text.splitlines() if ln.strip()[:1].isdigit()]
    assert [r[:3] for r in rows[:6]] == [
        ["0", "0", "checkpoint"], ["1", "1", "checkpoint"], ["2", "2", "checkpoint"], ["3", "3", "checkpoint"],
        ["4", "4", "keep"], ["5", "5", "checkpoint"],
    ]
    assert [r[1] for r in rows] == [str(i) for i in range(12)]


def test_long_names_without_a_common_prefix_are_printed_whole_and_aligned():
    names = ["encoder.embed_tokens_and_positions_of_a_long_name", "encoder.block.0", "decoder.block.0.layer.2.DenseReluDense"]
    names = ["a_stem_" + "x" * 40, *names]
    text = str(_plan(names))
    lines = text.splitlines()
    assert "block names below" not in text and "..." not in text
    for n in names:
        assert n in text
    header = next(ln for ln in lines if ln.lstrip().startswith("block  name"))
    rows = [ln for ln in lines if ln.strip()[:1].isdigit()]
    column = header.index("decision")
    assert all(r[column - 1] == " " and r[column] != " " for r in rows)  # decisions line up under their header
