"""Per-op profile of each block's forward: names as torch's selective checkpointing counts
them, work that adds up to the block's, saved / keepable / tail flags, kept bytes, fit."""

from __future__ import annotations

from collections import Counter, defaultdict
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from models import TinyChain, TinyCNN, tokens_batch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

from examples.train_encoder import EncoderClassifier
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.profiling.work.op_bytes import OpBytesCounter
from lightning_ckpt.profiling.work.op_profile import OpProfileRecorder, written_args
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.profiling.passes.profiler import probe_step
from lightning_ckpt.profiling.memory.tracker import storage_key

D = 16  # width of the hand-written blocks
F32 = 4


class SdpaBlock(nn.Module):
    """Residual attention through `F.scaled_dot_product_attention` (no dropout: the fused CPU kernel)."""

    def __init__(self, d: int = D, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


class InPlace(nn.Module):
    """A product written in place afterwards, a view of it, and a tanh (which saves its result)."""

    def forward(self, x):
        y = x * 2.0
        y.add_(1.0)
        return torch.tanh(y.view(-1, x.shape[-1])).view_as(x)


class Chain(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x.mean()


def _encoder(n_blocks: int = 2) -> EncoderClassifier:
    return EncoderClassifier(n_blocks=n_blocks, d_model=32, n_heads=4, seq_len=16, vocab_size=64, n_classes=4)


def _encoder_batch(n: int):
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 64, (n, 16), generator=g), torch.randint(0, 4, (n,), generator=g)


def _classify(model):
    return lambda batch: F.cross_entropy(model(batch[0]), batch[1])


def _case(name: str):
    """(model, step, batch) of a named case."""
    torch.manual_seed(0)
    if name == "encoder":
        model = _encoder()
        return model, _classify(model), _encoder_batch(4)
    if name == "mlp":
        model = TinyChain(n_blocks=3, d=D, p=0.1)
        return model, _classify(model), tokens_batch(batch=4, seq=8)
    if name == "cnn":
        model = TinyCNN(n_blocks=3, c=4)
        return model, lambda x: model(x).square().mean(), torch.randn(2, 3, 8, 8)
    blocks = {"sdpa": (SdpaBlock(), SdpaBlock()), "in_place": (InPlace(),)}[name]
    model = Chain(*blocks)
    return model, lambda x: model(x), torch.randn(4, 4, D)


CASES = ("encoder", "mlp", "cnn", "sdpa", "in_place")


def _probe(name: str) -> StepCost:
    model, step, batch = _case(name)
    return probe_step(model, list(model.blocks), step, batch, timing=False)


def _keys(block) -> list[tuple[str, int]]:
    return [op.key for op in block.ops]


def _is_random(op) -> bool:
    return op.rng_bytes > 0


# ----------------------------------------------------------------------------- naming


def _recording_policy(seen: list):
    """A selective checkpoint policy that recomputes everything and lists the ops of the forward."""

    def policy(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(func)
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.mark.parametrize("name", CASES)
def test_keys_are_those_torch_selective_checkpointing_counts(name):
    """Each block run alone under a selective checkpoint context: the policy sees the same
    ops in the same order, so its per-op numbering gives the profiled keys exactly."""
    cost = _probe(name)
    model, step, batch = _case(name)
    inputs = []
    handles = [b.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach())) for b in model.blocks]
    with torch.no_grad():
        step(batch)
    for h in handles:
        h.remove()
    for block, x, measured in zip(model.blocks, inputs, cost.blocks, strict=True):
        seen = []
        policy = _recording_policy(seen)
        x = x.clone().requires_grad_(True)
        checkpoint(block, x, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy))
        counts: dict = defaultdict(int)
        keys = []
        for func in seen:
            keys.append((str(func), counts[func]))
            counts[func] += 1
        assert keys == _keys(measured)
        assert keys  # the block ran ops


def test_encoder_block_names_its_ops_in_call_order():
    cost = _probe("encoder")
    first, second = cost.blocks
    keys = _keys(first)
    per_op = Counter(op for op, _ in keys)
    assert per_op["aten.addmm.default"] == 4  # qkv, attention out, fc, proj
    assert per_op["aten.bmm.default"] == 2  # q @ k^T, att @ v
    assert per_op["aten.native_layer_norm.default"] == 2
    assert per_op["aten._softmax.default"] == 1
    assert per_op["aten.gelu.default"] == 1
    assert per_op["aten.bernoulli_.float"] == 3  # attention dropout and both residual dropouts
    # each op's calls are numbered 0..k-1 in the order they ran
    seen: dict[str, int] = defaultdict(int)
    for op, index in keys:
        assert index == seen[op]
        seen[op] += 1
    # numbering starts again in every block, and nothing outside the blocks is recorded
    assert _keys(second) == keys
    assert keys[0] == ("aten.native_layer_norm.default", 0)
    assert not any("embedding" in op for op, _ in keys)
    assert "aten.detach.default" not in per_op  # skipped, as selective checkpointing skips it


def test_sdpa_block_records_the_fused_attention_call():
    """The CPU's fused attention is tagged random (for its dropout, 0 here): keeping it keeps clones of
    its output and log-sum-exp, costed at their bytes, not at one byte per element as a mask."""
    cost = _probe("sdpa")
    b, t, heads = 4, 4, 2
    for block in cost.blocks:
        attn = [op for op in block.ops if "scaled_dot_product" in op.op]
        assert len(attn) == 1 and attn[0].call_index == 0
        assert attn[0].saved and attn[0].keepable
        assert attn[0].keep_bytes == (b * t * D + b * heads * t) * F32  # output (b, heads, t, D / heads), lse (b, heads, t)


# ----------------------------------------------------------------------------- work


@pytest.mark.parametrize("name", CASES)
def test_op_work_adds_up_to_the_block(name):
    cost = _probe(name)
    for block in cost.blocks:
        assert block.ops
        assert sum(op.flops for op in block.ops) == block.fwd_flops
        assert sum(op.mem_bytes for op in block.ops) == block.fwd_mem_bytes
        assert sum(op.rng_bytes for op in block.ops) == block.fwd_rng_bytes
        tail = [op for op in block.ops if op.in_tail]
        assert sum(op.flops for op in tail) == block.tail_flops
        assert sum(op.mem_bytes for op in tail) == block.tail_mem_bytes
        assert sum(op.rng_bytes for op in tail) == block.tail_rng_bytes
        # the tail is a suffix of the calls
        flags = [op.in_tail for op in block.ops]
        assert flags == sorted(flags)


def test_op_bytes_counter_hands_each_op_its_own_share():
    seen = []
    x = torch.randn(8, D, requires_grad=True)
    w = torch.randn(D, D, requires_grad=True)
    with FlopCounterMode(display=False) as flops, OpBytesCounter(flops) as work:
        work.on_op = lambda func, args, kwargs, outs, f, mem, rng: seen.append((str(func), len(outs), f, mem, rng))
        F.dropout(torch.relu(x @ w), 0.5).sum()
    assert sum(s[2] for s in seen) == flops.get_total_flops() == 2 * 8 * D * D
    assert sum(s[3] for s in seen) == work.mem_bytes
    assert sum(s[4] for s in seen) == work.rng_bytes == 8 * D * F32
    assert ("aten.mm.default", 1, 2 * 8 * D * D, 0, 0) in seen


# ----------------------------------------------------------------------------- flags and bytes


@pytest.mark.parametrize("name", CASES)
def test_kept_bytes_of_saved_calls_fit_in_what_the_block_saves(name):
    cost = _probe(name)
    for block in cost.blocks:
        kept = sum(op.keep_bytes for op in block.ops if op.saved and op.keepable and not _is_random(op))
        assert 0 < kept <= block.saved_bytes


@pytest.mark.parametrize("name", ["encoder", "mlp"])
def test_saved_calls_account_for_every_saved_byte(name):
    """Every storage such a block saves is its input or made by exactly one of its calls,
    whole (dropout's noise by `empty_like`): the saved calls' new storages add up exactly."""
    cost = _probe(name)
    for block in cost.blocks:
        made = sum(op.keep_bytes for op in block.ops if op.saved and not _is_random(op))
        assert made + block.input_saved_bytes == block.saved_bytes


def test_mlp_block_flags():
    """LayerNorm -> fc1 -> GELU -> fc2 -> dropout -> residual add, at batch 4 x 8 tokens x 16."""
    n = 4 * 8 * D
    ops = {op.key: op for op in _probe("mlp").blocks[1].ops}
    assert list(ops) == [
        ("aten.native_layer_norm.default", 0), ("aten.view.default", 0), ("aten.t.default", 0),
        ("aten.addmm.default", 0), ("aten.view.default", 1), ("aten.gelu.default", 0),
        ("aten.view.default", 2), ("aten.t.default", 1), ("aten.addmm.default", 1), ("aten.view.default", 3),
        ("aten.empty_like.default", 0), ("aten.bernoulli_.float", 0), ("aten.div_.Scalar", 0),
        ("aten.mul.Tensor", 0), ("aten.add.Tensor", 0),
    ]  # fmt: skip
    fc1, fc2 = ops[("aten.addmm.default", 0)], ops[("aten.addmm.default", 1)]
    assert fc1.saved and fc1.keepable and fc1.keep_bytes == 4 * n * F32  # saved by the GELU after it
    assert not fc2.saved and fc2.keep_bytes == n * F32  # dropout saves its noise, not its input
    norm = ops[("aten.native_layer_norm.default", 0)]
    assert norm.saved and norm.keep_bytes == (n + 2 * 4 * 8) * F32  # output, mean, rstd
    draw = ops[("aten.bernoulli_.float", 0)]
    assert draw.saved and draw.keepable and draw.keep_bytes == n  # one byte per draw
    noise = ops[("aten.empty_like.default", 0)]
    assert noise.saved and not noise.keepable  # written in place later: not keepable as it was made
    scale = ops[("aten.div_.Scalar", 0)]
    assert not scale.keepable and scale.keep_bytes == 0
    for key in [("aten.view.default", 0), ("aten.t.default", 1)]:
        assert not ops[key].keepable and ops[key].keep_bytes == 0 and not ops[key].saved
    assert [k for k, op in ops.items() if op.in_tail] == [("aten.mul.Tensor", 0), ("aten.add.Tensor", 0)]


def test_in_place_write_makes_the_creator_unkeepable():
    ops = _probe("in_place").blocks[0].ops
    by_op = {op.op.split(".")[1]: op for op in ops}
    n = 4 * 4 * D
    assert not by_op["mul"].keepable and by_op["mul"].keep_bytes == n * F32 and not by_op["mul"].saved
    assert not by_op["add_"].keepable and by_op["add_"].keep_bytes == 0
    assert not by_op["view"].keepable and by_op["view"].keep_bytes == 0
    tanh = by_op["tanh"]
    assert tanh.keepable and tanh.saved and tanh.keep_bytes == n * F32 and not tanh.in_tail
    assert ops[-1].op == "aten.view.default" and ops[-1].in_tail


def test_a_storage_made_again_at_a_freed_address_marks_only_its_new_maker():
    """The allocator may give a new tensor the address of one freed earlier in the block: a
    tensor saved then is the new call's output. Shown to the recorder directly: the second
    call returns a tensor on the first one's storage that is not one of its inputs."""
    aten = torch.ops.aten
    x = torch.randn(4, D)
    first = aten.mul.Tensor(x, x)
    again = first.view(-1)  # the same storage key, as a reused address has
    rec = OpProfileRecorder()
    rec.begin()
    rec.record(aten.mul.Tensor, (x, x), {}, [first], 0, first.nbytes, 0)
    rec.packed(None)  # a parameter saved: not the block's activation, but it moves the tail
    rec.record(aten.exp.default, (), {}, [again], 0, again.nbytes, 0)
    rec.packed(storage_key(again))
    rec.record(aten.add.Tensor, (again, again), {}, [again + again], 0, again.nbytes, 0)
    ops = rec.end()
    assert [(op.key, op.saved, op.in_tail) for op in ops] == [
        (("aten.mul.Tensor", 0), False, False),
        (("aten.exp.default", 0), True, False),
        (("aten.add.Tensor", 0), False, True),
    ]
    rec.begin()  # the next block numbers its calls from 0 and remembers nothing
    rec.record(aten.exp.default, (), {}, [again], 0, 0, 0)
    assert [(op.key, op.saved, op.in_tail) for op in rec.end()] == [(("aten.exp.default", 0), False, True)]


def test_written_args_read_the_schema():
    aten = torch.ops.aten
    assert written_args(aten.bernoulli_.float) == ((0, "self"),)
    assert written_args(aten.add.out) == ((3, "out"),)
    assert written_args(aten.mm.default) == ()


# ----------------------------------------------------------------------------- across batch sizes


def test_profile_fits_op_bytes_linearly_within_2_percent():
    torch.manual_seed(0)
    model = _encoder()
    step = _classify(model)
    blocks = list(model.blocks)
    prof = profile_model(model, blocks, step, _encoder_batch(8), (2, 4), check_batch_size=None, timing=False)
    small, large = prof.probes
    for a, b in zip(small.blocks, large.blocks, strict=True):
        assert _keys(a) == _keys(b) and a.ops
    measured = probe_step(model, list(model.blocks), step, _encoder_batch(8), timing=False)
    predicted = prof.at(8)
    for p, m in zip(predicted.blocks, measured.blocks, strict=True):
        assert _keys(p) == _keys(m)
        for po, mo in zip(p.ops, m.ops, strict=True):
            for field in ("keep_bytes", "flops", "mem_bytes", "rng_bytes"):
                assert getattr(po, field) == pytest.approx(getattr(mo, field), rel=0.02), (po.key, field)
            assert (po.saved, po.keepable, po.in_tail) == (mo.saved, mo.keepable, mo.in_tail)
        assert sum(op.keep_bytes for op in m.ops) > 2 * sum(op.keep_bytes for op in small.blocks[0].ops)


def test_ops_round_trip_through_a_dict():
    cost = _probe("encoder")
    again = StepCost.from_dict(cost.to_dict())
    assert [b.ops for b in again.blocks] == [b.ops for b in cost.blocks]
