"""A recompute runs on the module state the original forward saw and leaves the state the forward
left: training with a plan applied is bit-identical (losses, parameters, every buffer and its shape)
to training without one, for modules that write state in their forward and compute with it."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from models import loop_steps
from torch import nn
from torch.ao import quantization as tq

from lightning_ckpt import auto_checkpoint, apply_segments, make_plan
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.engine.target_plan import cost_at
from lightning_ckpt.profiling.memory.static_memory import static_memory

pytestmark = pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max")  # torch's x86 qconfig

D, BATCH, STEPS = 8, 6, 3
# one-block segments and a multi-block segment; one outer segment with an inner one recomputed inside it
PLANS = {
    "segments": ([(0, 0), (2, 4)], []),
    "nested": ([(0, 3)], [(1, 2)]),
}


class Counter(nn.Module):
    """A buffer counter incremented in forward and used in the math."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count += 1
        return x * (1.0 + 0.1 * self.count)


class Ema(nn.Module):
    """A buffer rebound each forward to a new tensor under the same name."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x):
        self.ema = self.ema * 0.9 + x.mean(0).detach() * 0.1
        return x - self.ema


class Instance(nn.Module):
    """InstanceNorm with running statistics on (N, C, L)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm1d(D, track_running_stats=True, affine=True)

    def forward(self, x):
        return self.norm(x.unsqueeze(-1).expand(-1, -1, 3) * torch.arange(1.0, 4.0)).mean(-1)


def _stateful(kind: str, d: int = D) -> nn.Module:
    if kind == "spectral_norm":
        return nn.utils.spectral_norm(nn.Linear(d, d))
    if kind == "parametrized_spectral_norm":
        return nn.utils.parametrizations.spectral_norm(nn.Linear(D, D))
    if kind == "counter":
        return Counter()
    if kind == "rebound_buffer":
        return Ema()
    if kind == "batchnorm_cumulative":
        return nn.BatchNorm1d(D, momentum=None)
    if kind == "instancenorm":
        return Instance()
    return nn.Linear(D, D)  # QAT kinds: prepare_qat puts fake-quantize modules around it


class Net(nn.Module):
    def __init__(self, kind: str, n_blocks: int = 5, d: int = D) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), _stateful(kind, d), nn.Tanh()) for _ in range(n_blocks)
        )
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x).squeeze(-1)


def _model(kind: str) -> Net:
    torch.manual_seed(0)
    model = Net(kind)
    if kind.startswith("qat"):
        model.qconfig = tq.default_qat_qconfig if kind == "qat_per_tensor" else tq.get_default_qat_qconfig("x86")
        tq.prepare_qat(model, inplace=True)
    return model


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, plan=None, guard: bool = True):
    handle = None
    if plan is not None:
        segments, inner = plan
        handle = apply_segments(list(model.blocks), segments, guard_batchnorm=guard, inner_segments=inner)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for x, y in _batches():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, handle


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **{f"buffer {k}": v for k, v in model.named_buffers()}}


def _identical(ref, other) -> list[str]:
    """Names of what differs between two trained runs (losses, parameters, buffers)."""
    (ref_model, ref_losses), (model, losses) = ref, other
    bad = [f"loss {i}" for i, (a, b) in enumerate(zip(ref_losses, losses)) if not torch.equal(a, b)]
    a, b = _state(ref_model), _state(model)
    assert a.keys() == b.keys()
    return bad + [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


KINDS = [
    "spectral_norm", "parametrized_spectral_norm", "qat_per_tensor", "qat_x86", "counter", "rebound_buffer",
    "batchnorm_cumulative", "instancenorm",
]


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", KINDS)
def test_training_is_bit_identical_to_training_without_a_plan(kind, plan):
    ref_model = _model(kind)
    ref = (ref_model, _train(ref_model)[0])
    model = _model(kind)
    losses, handle = _train(model, PLANS[plan])
    assert _identical(ref, (model, losses)) == []
    handle.remove()
    if plan == "segments":  # without the guard a recompute runs on, and advances, the state the forward left
        unguarded = _model(kind)
        assert _identical(ref, (unguarded, _train(unguarded, PLANS[plan], guard=False)[0])) != []


def test_buffers_keep_their_objects_and_a_rebound_one_keeps_the_forwards():
    model = _model("rebound_buffer")
    handle = apply_segments(list(model.blocks), [(0, 1), (2, 2)])
    x, y = _batches()[0]
    loss = F.mse_loss(model(x), y)
    after_forward = [blk[1].ema for blk in model.blocks]
    loss.backward()
    assert all(blk[1].ema is t for blk, t in zip(model.blocks, after_forward))
    handle.remove()
    model = _model("spectral_norm")
    ids = {k: id(v) for k, v in model.named_buffers()}
    _train(model, PLANS["nested"])
    assert {k: id(v) for k, v in model.named_buffers()} == ids


def test_several_backwards_of_one_forward_recompute_on_the_same_state():
    def grads(plan):
        model = _model("spectral_norm")
        if plan:
            segments, inner = PLANS[plan]
            apply_segments(list(model.blocks), segments, inner_segments=inner)
        x, y = _batches()[0]
        loss = F.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad for p in model.parameters()], dict(model.named_buffers())

    ref_grads, ref_buffers = grads(None)
    for plan in PLANS:
        g, buffers = grads(plan)
        assert all(torch.equal(a, b) for a, b in zip(ref_grads, g))
        assert all(torch.equal(ref_buffers[k], buffers[k]) for k in ref_buffers)


def test_a_segment_that_writes_nothing_takes_no_snapshot():
    torch.manual_seed(0)
    model = Net("plain")
    handle = apply_segments(list(model.blocks), [(0, 1), (3, 3)])
    _train(model)
    for seg in handle._segments:
        assert seg.state_guard.written_slots() == ()
        forward, recompute = seg.state_guard.contexts()
        assert isinstance(forward, contextlib.nullcontext) and isinstance(recompute, contextlib.nullcontext)
    model = _model("counter")
    handle = apply_segments(list(model.blocks), [(0, 1)])
    _train(model)
    assert [s.name for s in handle._segments[0].state_guard.written_slots()] == ["count", "count"]


def test_auto_checkpoint_trains_a_spectral_norm_model_bit_identically():
    def model():
        torch.manual_seed(0)
        return Net("spectral_norm", n_blocks=6, d=64)

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(32, 64, generator=g), torch.randn(32, generator=g)) for _ in range(STEPS)]

    def loss_fn(m):
        return lambda b: F.mse_loss(m(b[0]), b[1])

    probe = model()
    opt = torch.optim.AdamW(probe.parameters(), lr=0.05)
    profile = profile_model(probe, list(probe.blocks), loss_fn(probe), batches[0], timing=False)
    # `loop_steps` frees the gradients after each step: none in the forward, as `auto_checkpoint` reads it
    cost = dataclasses.replace(cost_at(profile, 32, static_memory(probe, [opt])), grads_live_in_forward=False)
    assert all(b.written_state_bytes == 64 * 64 * 4 + 2 * 64 * 4 for b in cost.blocks)  # weight, u, v
    lo, hi = (make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
    assert lo < hi
    # the memory model counts the copies: every plan's peak rises by them, a chain without state is as before
    stateless = dataclasses.replace(
        cost, blocks=tuple(dataclasses.replace(b, written_state_bytes=0) for b in cost.blocks)
    )
    for policy in ("full", "none"):
        rise = make_plan(cost, policy).predicted_peak_bytes - make_plan(stateless, policy).predicted_peak_bytes
        assert rise == sum(b.written_state_bytes for b in cost.blocks)

    def train(m, handle=None, opt=None):
        return loop_steps(loss_fn(m), batches, opt or torch.optim.AdamW(m.parameters(), lr=0.05), handle)

    plain = model()
    ref = (plain, train(plain))
    checkpointed = model()
    opt = torch.optim.AdamW(checkpointed.parameters(), lr=0.05)
    handle = auto_checkpoint(
        checkpointed, (lo + hi) // 2, example_batch=batches[0], step_fn=loss_fn(checkpointed), optimizer=opt,
        blocks="blocks", cost_metric="flops", verbose=False,
    )
    assert handle.plan.segments
    losses = train(checkpointed, handle, opt)
    assert _identical(ref, (checkpointed, losses)) == []
    handle.remove()


@pytest.mark.parametrize("kind", ["spectral_norm", "qat_x86", "rebound_buffer"])
def test_regions_of_the_compile_form_run_eagerly_on_the_state_the_forward_saw(kind):
    from lightning_ckpt.apply.compiled import apply_compiled_segments

    ref_model = _model(kind)
    ref = (ref_model, _train(ref_model)[0])
    model = _model(kind)
    handle = apply_compiled_segments(list(model.blocks), [(0, 0), (2, 3)])
    losses, _ = _train(model)
    assert _identical(ref, (model, losses)) == []
    handle.remove()


def test_a_deep_copy_guards_its_own_state():
    import copy

    model = _model("parametrized_spectral_norm")  # the older spectral_norm cannot be deep-copied after a forward
    handle = apply_segments(list(model.blocks), [(0, 1), (3, 3)])
    _train(model)  # the written state is found, on the original's modules
    twin = copy.deepcopy(model)  # with its own copy of the plan
    handle.remove()
    ref = copy.deepcopy(model)
    ref_losses, _ = _train(ref)  # the same steps again, without a plan
    losses, _ = _train(twin)
    assert _identical((ref, ref_losses), (twin, losses)) == []


class AliasWriter(nn.Module):
    """Writes its buffer through a reference of its own, not through the module attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(()))
        self.refs = [self.n]

    def forward(self, x):
        self.refs[0].add_(1)
        return x * self.refs[0]


def test_a_recompute_that_writes_state_through_another_reference_is_reported():
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), AliasWriter()) for _ in range(2))
    apply_segments(list(blocks), [(0, 1)])
    x = torch.randn(BATCH, D)
    out = blocks[1](blocks[0](x))
    with pytest.warns(UserWarning, match=r"wrote the module state AliasWriter\.n.* through another reference"):
        out.sum().backward()
