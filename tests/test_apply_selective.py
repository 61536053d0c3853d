"""Op-level (selective) checkpointing: kept op calls are not recomputed, training stays bit-exact.

The encoder block of `examples/train_encoder.py` (LayerNorm, Linear, GELU, attention with a
dropout on its weights, two residual dropouts) checkpointed alone, keeping matmuls, dropout
draws or everything keepable; against no checkpointing, with dropout active, in fp32 and
under bf16 autocast. Also BatchNorm statistics, recompute counts, memory and the errors.
"""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
from models import TinyCNN, train_steps
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from examples.train_encoder import EncoderBlock
from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.apply.kept_draws import DrawKeeper, DrawReplayer, _compact
from lightning_ckpt.profiling.work.op_keys import OpCallCounter, is_random_op
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker, storage_bytes, storage_key

D, HEADS, SEQ, BATCH = 32, 4, 16, 4
MATMULS = ("aten.addmm.default", "aten.bmm.default", "aten.mm.default")


class EncoderChain(nn.Module):
    """Encoder blocks on float input -> mean pool -> linear head."""

    def __init__(self, n_blocks: int = 3, p: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(D, HEADS, p) for _ in range(n_blocks))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(x.mean(dim=1))


def _tensors(value):
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class CallRecorder(TorchDispatchMode):
    """Every numbered op call of a forward: its key, whether it is random, whether its outputs
    are new storages nobody writes later (keepable), and the bytes keeping it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = OpCallCounter()
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key = self.counter.key(func)
        if key is None:
            return out
        writes = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        inputs = {storage_key(t) for t in _tensors((args, kwargs))}
        outs = _tensors(out)
        random = is_random_op(func)
        new = bool(outs) and not func.is_view and not writes and all(storage_key(t) not in inputs for t in outs)
        # a kept draw: a bernoulli mask one byte per element, any other random op's outputs cloned
        mask = getattr(func, "_overloadpacket", None) in (torch.ops.aten.bernoulli_, torch.ops.aten.bernoulli)
        kept_bytes = (sum(t.numel() for t in outs) if mask else sum(t.numel() * t.element_size() for t in outs)) \
            if random else sum(storage_bytes(t) for t in outs)
        versions = [(t, t._version) for t in outs]
        self.calls.append({"key": key, "random": random, "new": new, "bytes": kept_bytes, "versions": versions})
        return out

    def keepable(self) -> list[tuple[str, int]]:
        return [
            c["key"] for c in self.calls
            if c["random"] or (c["new"] and all(t._version == v for t, v in c["versions"]))
        ]


def block_calls(autocast: bool = False) -> CallRecorder:
    torch.manual_seed(0)
    blk = EncoderBlock(D, HEADS, 0.1)
    x = torch.randn(BATCH, SEQ, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), CallRecorder() as rec:
        blk(x)
    return rec


def key_set(name: str, autocast: bool) -> list[tuple[str, int]]:
    rec = block_calls(autocast)
    random = [c["key"] for c in rec.calls if c["random"]]
    assert [k[0] for k in random] == ["aten.bernoulli_.float"] * 3  # attention, residual 1, residual 2
    return {
        "nothing": [],
        "matmuls": [c["key"] for c in rec.calls if c["key"][0] in MATMULS],
        "first_dropout": random[:1],
        "last_dropout": random[-1:],
        "every_random": random,
        "all_keepable": rec.keepable(),
    }[name]


def batches(n: int = 2):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, SEQ, D, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(n)]


def train(keep_ops, autocast: bool = False, steps: int = 3):
    """Losses and final gradients of `steps` SGD steps; `keep_ops=None`: no checkpointing."""
    torch.manual_seed(0)
    model = EncoderChain()
    if keep_ops is not None:
        apply_segments(list(model.blocks), [(i, i) for i in range(3)], keep_ops=keep_ops)
    torch.manual_seed(123)  # the same dropout stream in every run
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    data = batches()
    for i in range(steps):
        x, y = data[i % len(data)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


KEY_SETS = ["nothing", "matmuls", "first_dropout", "last_dropout", "every_random", "all_keepable"]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("name", KEY_SETS)
def test_bit_identical_to_no_checkpointing_with_dropout(name, autocast):
    keys = key_set(name, autocast)
    ref_losses, ref_grads = train(None, autocast)
    losses, grads = train({0: keys, 1: keys, 2: keys}, autocast)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert ref_grads.keys() == grads.keys() and len(grads) > 0
    for n in ref_grads:
        assert torch.equal(ref_grads[n], grads[n]), n


def test_all_keepable_includes_matmuls_and_draws_but_not_views_or_written_outputs():
    keys = set(key_set("all_keepable", False))
    assert {("aten.addmm.default", i) for i in range(4)} <= keys
    assert {("aten.bernoulli_.float", i) for i in range(3)} <= keys
    assert ("aten.view.default", 0) not in keys and ("aten._unsafe_view.default", 0) not in keys
    assert ("aten.empty_like.default", 0) not in keys  # written by bernoulli_ afterwards


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def backward_counts(keep_ops) -> dict[str, int]:
    """Ops that run in the backward (the recompute included) of one step."""
    torch.manual_seed(0)
    model = EncoderChain()
    apply_segments(list(model.blocks), [(i, i) for i in range(3)], keep_ops=keep_ops)
    x, y = batches(1)[0]
    loss = nn.functional.cross_entropy(model(x), y)
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_kept_calls_are_not_recomputed():
    matmuls = key_set("matmuls", False)
    first_draw = key_set("first_dropout", False)
    plain = backward_counts({})
    kept = backward_counts({i: matmuls + first_draw for i in range(3)})
    # plain checkpointing recomputes every block's 4 linear layers and 3 dropout draws
    assert plain["aten.addmm.default"] == 12 and plain["aten.bmm.default"] - kept["aten.bmm.default"] == 6
    assert kept.get("aten.addmm.default", 0) == 0
    assert plain["aten.bernoulli_.float"] == 9 and kept["aten.bernoulli_.float"] == 6
    # the kept mask is written back instead of drawn; everything else is recomputed as before
    assert kept["aten.copy_.default"] - plain.get("aten.copy_.default", 0) == 3
    for op in ("aten.gelu.default", "aten.native_layer_norm.default", "aten._softmax.default"):
        assert kept[op] == plain[op], op


def test_a_kept_fused_attention_holds_what_the_profile_costs():
    """`F.scaled_dot_product_attention` without dropout runs the CPU's fused kernel, tagged random: a
    kept call keeps clones of its output and log-sum-exp. Held after the forward, counted by a tracker
    of live storages apart from the library's, they are the call's profiled `keep_bytes`."""
    from models import PostNormAttentionBlock
    from storage_oracle import LiveStorages

    from lightning_ckpt.profiling.passes.profiler import probe_step

    torch.manual_seed(0)
    blk = PostNormAttentionBlock(16, p=0.0)
    chain = nn.Sequential(blk)
    x = torch.randn(BATCH, SEQ, 16)
    ops = probe_step(chain, [blk], lambda b: chain(b).square().mean(), x, timing=False).blocks[0].ops
    (attn,) = [op for op in ops if "scaled_dot_product" in op.op]
    apply_segments([blk], [(0, 0)], keep_ops={0: [attn.key]})
    x = x.clone().requires_grad_()
    with LiveStorages() as live:
        live.count([x, *blk.parameters()])
        before = live.bytes
        out = blk(x)
        held = live.bytes - before - out.untyped_storage().nbytes()
    assert held == attn.keep_bytes == 4 * (BATCH * SEQ * 16 + BATCH * 2 * SEQ)  # output, lse (2 heads)
    out.sum().backward()


def test_memory_after_forward_is_input_plus_kept_bytes():
    keys = key_set("matmuls", False) + key_set("first_dropout", False)
    rec = block_calls()
    kept_bytes = sum(c["bytes"] for c in rec.calls if c["key"] in set(keys))

    def held_after_forward(mode):
        torch.manual_seed(0)
        blk = EncoderBlock(D, HEADS, 0.1)
        if mode != "none":
            apply_segments([blk], [(0, 0)], keep_ops={0: keys} if mode == "selective" else None)
        with LiveBytesTracker() as tracker:
            x = torch.randn(BATCH, SEQ, D).requires_grad_()
            out = blk(x)
            held = tracker.live_bytes - storage_bytes(out)
        del out
        return held, storage_bytes(x)

    plain, x_bytes = held_after_forward("plain")
    selective, _ = held_after_forward("selective")
    none, _ = held_after_forward("none")
    assert plain == x_bytes
    # the generator state kept with the draw is not a tensor made by an op: not counted
    assert selective == x_bytes + kept_bytes
    assert plain < selective < none
    # fp32 outputs of the 4 linear layers (qkv, proj, fc, proj), of q @ k^T and att @ v, and one
    # byte per element of the attention dropout's mask
    linear = BATCH * SEQ * (3 * D + D + 4 * D + D)
    attention = BATCH * HEADS * SEQ * SEQ + BATCH * SEQ * D
    assert kept_bytes == 4 * (linear + attention) + BATCH * HEADS * SEQ * SEQ


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_statistics_bit_identical(momentum):
    def run(keep_ops):
        torch.manual_seed(0)
        model = TinyCNN(n_blocks=3, momentum=momentum)
        if keep_ops is not None:
            apply_segments(list(model.blocks), [(0, 0), (1, 1), (2, 2)], keep_ops=keep_ops)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(2)]
        losses, grads = train_steps(model, data, 4)
        return model, losses, grads

    keep = [("aten.convolution.default", 0), ("aten.relu.default", 0)]
    ref, ref_losses, ref_grads = run(None)
    model, losses, grads = run({0: keep, 2: keep[:1]})
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(ref_grads[n], grads[n]) for n in ref_grads)
    buffers = dict(model.named_buffers())
    for n, buf in ref.named_buffers():
        assert torch.equal(buf, buffers[n]), n
    assert int(buffers["blocks.0.bn.num_batches_tracked"]) == 4


class DrawingBlock(nn.Module):
    """Random ops that return new tensors: `rand_like` (uniform floats, not a 0/1 mask), `bernoulli`
    (a 0/1 mask) and `randn` from a generator of the caller's."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h * (torch.rand_like(h) > 0.2) * torch.bernoulli(torch.full_like(h, 0.7))
        noise = torch.randn(h.shape, generator=self.generator)
        return torch.tanh(h + 0.1 * noise) * torch.rand_like(h)


@pytest.mark.parametrize("explicit_generator", [False, True])
def test_kept_out_of_place_draws(explicit_generator):
    """Kept `rand_like`/`randn` calls replay their values: bit-exact gradients; a kept draw from the
    caller's generator is not drawn again, and that generator is left as the forward left it."""

    def run(keep_ops):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(5) if explicit_generator else None
        blocks = nn.ModuleList([DrawingBlock(gen), DrawingBlock(gen)])
        if keep_ops is not None:
            apply_segments(list(blocks), [(0, 0), (1, 1)], keep_ops=keep_ops)
        torch.manual_seed(3)
        x = torch.randn(BATCH, SEQ, D, requires_grad=True)
        out = blocks[1](blocks[0](x))
        state = gen.get_state() if gen is not None else None
        with OpCounter() as counter:
            out.square().sum().backward()
        if gen is not None:
            assert torch.equal(gen.get_state(), state)
        return [p.grad for p in blocks.parameters()] + [x.grad], counter.counts

    randn = "aten.randn.generator"  # the generator overload also when the argument is None
    keys = [(randn, 0), ("aten.rand_like.default", 1), ("aten.bernoulli.default", 0)]
    ref, _ = run(None)
    grads, counts = run({0: keys, 1: keys})
    assert all(torch.equal(a, b) for a, b in zip(ref, grads))
    assert counts.get(randn, 0) == 0 and counts.get("aten.bernoulli.default", 0) == 0
    assert counts["aten.rand_like.default"] == 2  # the first of each block


@pytest.mark.parametrize(
    "values, compact",
    [
        (torch.tensor([0.0, 1.0, 1.0]), True),
        (torch.tensor([0.0, 1.0], dtype=torch.bfloat16), True),
        (torch.tensor([0, 1, 1]), True),
        (torch.tensor([-0.0, 1.0]), False),  # -0.0 == 0 but has other bits
        (torch.tensor([0.0, float("nan")]), False),
        (torch.tensor([0.0, 2.0]), False),
        (torch.tensor([0.25, 1.0]), False),
    ],
)
def test_kept_draws_are_stored_losslessly(values, compact):
    """One byte per element only when that loses nothing, bit for bit."""
    copy_, dtype = _compact(values)
    assert (copy_.dtype == torch.bool) == compact
    restored = copy_.to(dtype) if dtype is not None else copy_
    assert restored.dtype == values.dtype
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    assert torch.equal(restored.view(as_int), values.view(as_int))


def test_random_modes_sit_below_selective_checkpoint_modes():
    """The draw modes' own ops (copying masks, writing them back) must not be numbered by torch's
    caching modes, so they are entered first: lower in the dispatch mode stack, in both passes."""
    stacks = []
    torch.manual_seed(0)
    blk = EncoderBlock(D, HEADS, 0.1)
    blk.fc.register_forward_hook(lambda *_: stacks.append([type(m) for m in _get_current_dispatch_mode_stack()]))
    apply_segments([blk], [(0, 0)], keep_ops={0: key_set("first_dropout", False) + [("aten.addmm.default", 0)]})
    blk(torch.randn(BATCH, SEQ, D, requires_grad=True)).sum().backward()
    forward, recompute = stacks
    assert forward.index(DrawKeeper) < forward.index(_CachingTorchDispatchMode)
    assert recompute.index(DrawReplayer) < recompute.index(_CachedTorchDispatchMode)


def test_only_random_calls_kept_needs_no_caching_modes():
    stacks = []
    torch.manual_seed(0)
    blk = EncoderBlock(D, HEADS, 0.1)
    blk.fc.register_forward_hook(lambda *_: stacks.append([type(m) for m in _get_current_dispatch_mode_stack()]))
    apply_segments([blk], [(0, 0)], keep_ops={0: key_set("every_random", False)})
    blk(torch.randn(BATCH, SEQ, D, requires_grad=True)).sum().backward()
    assert stacks == [[DrawKeeper], [DrawReplayer]]


def one_block(keep_ops, segments=((0, 0),), n_blocks=1):
    torch.manual_seed(0)
    blocks = nn.ModuleList(EncoderBlock(D, HEADS, 0.1) for _ in range(n_blocks))
    return blocks, apply_segments(list(blocks), list(segments), keep_ops=keep_ops)


@pytest.mark.parametrize(
    "segments, keep_ops, match",
    [
        ([(0, 1)], {1: [("aten.addmm.default", 0)]}, r"names block 1, which is inside the segment \(0, 1\)"),
        ([(0, 0)], {1: [("aten.addmm.default", 0)]}, r"block 1, which is not in any segment .* \(1, 1\)"),
        ([(0, 0)], {5: []}, r"names block 5, but blocks are numbered 0..1"),
        ([(0, 0)], {0: [("aten.addmm.default", -1)]}, r"holds \('aten.addmm.default', -1\), which is not an op-call key"),
        ([(0, 0)], {0: ["aten.addmm.default"]}, r"holds 'aten.addmm.default', which is not an op-call key"),
        ([(0, 0)], {0: ("aten.addmm.default", 0)}, r"is the single value .* a collection of op-call keys"),
        ([(0, 0)], {0: "aten.addmm.default"}, r"is the single value 'aten.addmm.default'"),
    ],
    ids=["inside_segment", "not_checkpointed", "out_of_range", "negative_index", "bare_name", "single_key", "string"],
)
def test_keep_ops_must_name_a_one_block_segment_and_keys(segments, keep_ops, match):
    with pytest.raises(ValueError, match=match):
        one_block(keep_ops, segments, n_blocks=2)


@pytest.mark.parametrize(
    "keys, missing",
    [
        ([("aten.mm.default", 0), ("aten.addmm.default", 9), ("aten.addmm.default", 1)],
         "[('aten.addmm.default', 9), ('aten.mm.default', 0)]"),
        ([("aten.bernoulli_.float", 3), ("aten.bernoulli_.float", 0)], "[('aten.bernoulli_.float', 3)]"),
    ],
    ids=["with_caching_modes", "random_calls_only"],
)
def test_unknown_keys_raise_at_first_forward_naming_missing_and_made_calls(keys, missing):
    blocks, _ = one_block({0: keys})
    x = torch.randn(BATCH, SEQ, D, requires_grad=True)
    with pytest.raises(ValueError, match="never made: " + re.escape(missing)) as err:
        blocks[0](x)
    assert "aten.addmm.default 0..3" in str(err.value) and "aten.bernoulli_.float 0..2" in str(err.value)
    with pytest.raises(ValueError, match="never made"):  # still checked: no forward has passed
        blocks[0](x)


@pytest.mark.parametrize(
    "key, match",
    [
        (("aten.view.default", 0), "is a view of its input"),
        (("aten._unsafe_view.default", 0), "shares storage with one of its inputs"),
        (("aten.div_.Scalar", 0), "writes its argument 'self' in place"),
        (("aten.empty_like.default", 0), "written in place later in the block's forward"),
    ],
)
def test_calls_that_cannot_be_kept_raise_at_first_forward(key, match):
    blocks, handle = one_block({0: [key]})
    x = torch.randn(BATCH, SEQ, D, requires_grad=True)
    with pytest.raises(ValueError, match=rf"keep_ops\[0\] keeps \('{key[0]}', 0\), but .*{match}"):
        blocks[0](x)
    handle.remove()
    blocks[0](x).sum().backward()  # nothing is left behind


def test_second_backward_through_kept_draws_raises():
    blocks, _ = one_block({0: key_set("every_random", False)})
    out = blocks[0](torch.randn(BATCH, SEQ, D, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recomputed a second time .* kept random draw"):
        out.backward()


def test_keep_ops_exposed_and_remove_restores_modules():
    torch.manual_seed(0)
    model = EncoderChain()
    keys = list(model.state_dict().keys())
    plain = copy.deepcopy(model)
    matmuls = key_set("matmuls", False)
    handle = apply_segments(list(model.blocks), [(0, 0), (1, 2)], keep_ops={0: matmuls})
    assert handle.keep_ops == {0: frozenset(matmuls)}
    assert list(model.state_dict().keys()) == keys
    # copies of the model keep the same calls and train
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        clone(batches(1)[0][0]).sum().backward()
        assert all(p.grad is not None for p in clone.parameters())
        hooks = next(iter(clone.blocks[0]._forward_pre_hooks.values())).__self__
        segment = hooks.by_entry[0][0]
        assert segment.selective.keys == frozenset(matmuls) and segment.blocks[0] is clone.blocks[0]
    handle.remove()
    assert handle.keep_ops == {} and not handle.active
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in model.blocks)
    assert list(model.state_dict().keys()) == keys
    x = batches(1)[0][0]
    torch.manual_seed(9)
    out = model(x)
    torch.manual_seed(9)
    assert torch.equal(out, plain(x))


def test_keys_are_checked_on_the_first_forward_only():
    """Once a forward has made every kept call, later forwards may make fewer (eval mode draws nothing)."""
    blocks, _ = one_block({0: key_set("every_random", False) + [("aten.addmm.default", 0)]})
    x = torch.randn(BATCH, SEQ, D, requires_grad=True)
    blocks[0](x).sum().backward()
    blocks.eval()
    blocks[0](x).sum().backward()
    assert x.grad is not None
