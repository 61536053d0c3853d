"""Applying plans: bit-exact training, BatchNorm guard, module tree untouched, undo."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from models import (
    FedChain,
    IdentityWrap,
    TinyChain,
    TinyCNN,
    tokens_batch,
    train_steps,
    wrap_like_zero3,
)
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt.apply.segments import apply_segments

SEGMENTATIONS = [
    [(0, 0)],
    [(i, i) for i in range(6)],
    [(0, 1), (2, 3), (4, 5)],
    [(0, 5)],
    [(1, 2), (4, 4)],
]


def _run(segments, seed=0, steps=3):
    torch.manual_seed(seed)
    model = TinyChain(n_blocks=6, p=0.2)
    handle = apply_segments(list(model.blocks), segments) if segments else None
    torch.manual_seed(123)  # same dropout stream
    batches = [tokens_batch(seed=s) for s in range(3)]
    losses, grads = train_steps(model, batches, steps)
    return model, handle, losses, grads


@pytest.mark.parametrize("segments", SEGMENTATIONS)
def test_bit_identical_losses_and_grads_with_dropout(segments):
    _, _, ref_losses, ref_grads = _run(None)
    _, _, losses, grads = _run(segments)
    assert len(ref_grads) == len(grads) > 0
    for a, b in zip(ref_losses, losses):
        assert torch.equal(a, b)
    for name in ref_grads:
        assert torch.equal(ref_grads[name], grads[name]), name


def test_state_dict_keys_and_module_tree_unchanged_and_remove_restores():
    torch.manual_seed(0)
    model = TinyChain()
    keys = list(model.state_dict().keys())
    names = [n for n, _ in model.named_modules()]
    handle = apply_segments(list(model.blocks), [(0, 2), (3, 3)])
    assert list(model.state_dict().keys()) == keys
    assert [n for n, _ in model.named_modules()] == names
    assert all(len(b._forward_pre_hooks) == 1 for b in model.blocks[:4])
    handle.remove()
    assert all(len(b._forward_pre_hooks) == 0 and len(b._forward_hooks) == 0 for b in model.blocks)
    assert not handle.active


def test_recompute_really_happens_flops():
    """Step FLOPs = plain step + forward FLOPs of the checkpointed blocks."""
    torch.manual_seed(0)
    x, y = tokens_batch(batch=8, seq=16)

    def step_flops(model):
        with FlopCounterMode(display=False) as fc:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        return fc.get_total_flops()

    def block_fwd_flops(model, idx):
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            h = model.embed(x)
            for i, blk in enumerate(model.blocks):
                if i == idx:
                    start = fc.get_total_flops()
                    h = blk(h)
                    return fc.get_total_flops() - start
                h = blk(h)

    model = TinyChain(n_blocks=6, p=0.0)
    base = step_flops(model)
    segs = [(1, 2), (4, 4)]
    full_fwd = sum(block_fwd_flops(model, i) for i in (1, 2, 4))
    handle = apply_segments(list(model.blocks), segs, early_stop=False)
    assert step_flops(model) == pytest.approx(base + full_fwd, rel=0.01)
    handle.remove()
    # With torch's early stop the last block of each segment skips its final matmul
    # (fc2: nothing after it is saved): 2 segments x B*S*4d*d*2 FLOPs fewer.
    apply_segments(list(model.blocks), segs)
    tail = 2 * (8 * 16 * 64 * 16 * 2)
    assert step_flops(model) == pytest.approx(base + full_fwd - tail, rel=0.01)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_statistics_bit_identical_with_guard(momentum):
    def run(segments, guard=True):
        torch.manual_seed(0)
        model = TinyCNN(n_blocks=4, momentum=momentum)
        if segments:
            apply_segments(list(model.blocks), segments, guard_batchnorm=guard)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(3)]
        losses, _ = train_steps(model, batches, 3)
        return model, losses

    ref, ref_losses = run(None)
    guarded, losses = run([(0, 1), (2, 2)])
    unguarded, _ = run([(0, 1), (2, 2)], guard=False)
    for a, b in zip(ref_losses, losses):
        assert torch.equal(a, b)
    for name, buf in ref.named_buffers():
        assert torch.equal(buf, dict(guarded.named_buffers())[name]), name
    # Without the guard, the recompute updates the statistics a second time.
    nbt = dict(unguarded.named_buffers())["blocks.0.bn.num_batches_tracked"]
    assert int(nbt) == 6 and int(dict(ref.named_buffers())["blocks.0.bn.num_batches_tracked"]) == 3
    assert not torch.equal(dict(unguarded.named_buffers())["blocks.0.bn.running_mean"], dict(ref.named_buffers())["blocks.0.bn.running_mean"])


def test_deepcopy_and_pickle_use_their_own_weights():
    torch.manual_seed(0)
    model = TinyChain(p=0.0)
    apply_segments(list(model.blocks), [(0, 5)])
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    x, _ = tokens_batch()
    assert not torch.equal(model(x), clone(x))
    restored = pickle.loads(pickle.dumps(clone))
    assert torch.equal(restored(x), clone(x))
    # the copy still checkpoints and trains
    restored(x).sum().backward()
    assert all(p.grad is not None for p in restored.blocks.parameters())


def test_segment_broken_chain_raises_clear_error():
    torch.manual_seed(0)
    model = TinyChain(p=0.0)
    apply_segments(list(model.blocks), [(0, 1)])
    x = model.embed(tokens_batch()[0])
    model.blocks[0](x)
    with pytest.raises(RuntimeError, match="did not receive the previous block's output"):
        model.blocks[1](x * 2)
    # the next forward works again
    out = model.blocks[1](model.blocks[0](x))
    out.sum().backward()


@pytest.mark.parametrize("segments", [[(0, 1), (2, 3)], [(0, 3)], [(1, 3)]])
def test_multi_block_segment_across_identity_functions_like_zero3(segments):
    """DeepSpeed ZeRO-3 wraps every module's inputs and outputs in identity autograd Functions
    (and its hooks fire again in the recompute): multi-block segments are accepted across them,
    rebuilt through them, and train bit for bit as without checkpointing."""

    def run(segments):
        torch.manual_seed(0)
        model = TinyChain(n_blocks=4, p=0.2)
        calls = wrap_like_zero3(model)
        if segments:
            apply_segments(list(model.blocks), segments)
        torch.manual_seed(123)
        losses, grads = train_steps(model, [tokens_batch(seed=s) for s in range(2)], steps=2)
        return losses, grads, [calls[b] for b in model.blocks]

    ref_losses, ref_grads, ref_calls = run(None)
    losses, grads, calls = run(segments)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert ref_grads.keys() == grads.keys() and len(grads) > 0
    for name in ref_grads:
        assert torch.equal(ref_grads[name], grads[name]), name
    # every checkpointed block ran again in the recompute, through the wrapping hooks
    checkpointed = {i for a, b in segments for i in range(a, b + 1)}
    assert calls == [c * (2 if i in checkpointed else 1) for i, c in enumerate(ref_calls)]


@pytest.mark.parametrize(
    "feed",
    [lambda x: x.clone(), lambda x: x + 0, lambda x: IdentityWrap.apply(x.clone()), lambda x: x.detach(),
     lambda x: x.mul_(2)],
    ids=["clone", "plus_zero", "clone_in_identity_function", "detached", "written_in_place"],
)
def test_segment_rejects_a_copy_or_changed_output(feed):
    torch.manual_seed(0)
    model = FedChain(feed, n_blocks=3, p=0.0)
    apply_segments(list(model.blocks), [(0, 1)])
    x, y = tokens_batch()
    with pytest.raises(RuntimeError, match="block 1 of a checkpointed segment did not receive the previous block's"):
        model(x)


def test_autocast_bf16_matches_without_checkpoint():
    def run(segments):
        torch.manual_seed(0)
        model = TinyChain(p=0.1)
        if segments:
            apply_segments(list(model.blocks), segments)
        torch.manual_seed(5)
        x, y = tokens_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss, [p.grad.clone() for p in model.parameters()]

    l0, g0 = run(None)
    l1, g1 = run([(0, 2), (3, 5)])
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
