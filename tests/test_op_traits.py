"""An overload's traits answer as the lookups they stand for, and follow torch's FLOP registry."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

from lightning_ckpt.profiling.work import op_traits
from lightning_ckpt.profiling.memory.collective_release import is_issued_collective
from lightning_ckpt.profiling.work.op_bytes import is_random, write_kind
from lightning_ckpt.profiling.work.op_keys import OpCallCounter, counted, op_name
from lightning_ckpt.profiling.work.op_profile import written_args
from lightning_ckpt.profiling.work.op_traits import QUERIES, traits_of

aten = torch.ops.aten
OPS = [
    aten.mm.default, aten.add.Tensor, aten.add_.Tensor, aten.bernoulli_.float, aten.view.default,
    aten.detach.default, aten.empty_like.default, aten.size.default, aten.native_layer_norm.default,
    aten._unsafe_view.default, aten.native_batch_norm.default,
]


def test_traits_answer_as_the_lookups_they_stand_for():
    for func in OPS:
        t = traits_of(func)
        assert t.func is func and traits_of(func) is t
        assert t.query == (func in QUERIES)
        assert t.write_kind == write_kind(func)
        assert t.random == is_random(func)
        assert t.issued == is_issued_collective(func)
        assert t.counted == counted(func)
        assert t.name == (op_name(func) if counted(func) else None)
        assert t.written_args == written_args(func)
        assert t.is_view == bool(getattr(func, "is_view", False))
        assert t.formula is flop_registry.get(func._overloadpacket)
    assert traits_of(aten.mm.default).shape_formula is not None
    assert traits_of(aten.add.Tensor).formula is None
    assert traits_of(aten.size.default).query and not traits_of(aten.detach.default).counted


def test_a_flop_formula_registered_later_is_seen(monkeypatch):
    func = aten.add.Tensor
    assert traits_of(func).formula is None
    monkeypatch.setitem(flop_registry, func._overloadpacket, lambda *a, **k: 7)
    assert traits_of(func).formula is flop_registry[func._overloadpacket]
    monkeypatch.undo()
    assert traits_of(func).formula is None


def test_decomposes_follows_the_kernels():
    assert traits_of(aten.mm.default).decomposes() is False  # a kernel of its own, no decomposition
    assert traits_of(aten.linear.default).decomposes() is True  # CompositeImplicitAutograd


def test_call_keys_by_name_count_as_keys_by_overload():
    counter = OpCallCounter()
    assert counter.key(aten.mm.default) == ("aten.mm.default", 0)
    assert counter.key_named(traits_of(aten.mm.default).name) == ("aten.mm.default", 1)
    assert counter.key(aten.detach.default) is None
    assert op_traits.traits_of(aten.detach.default).name is None
