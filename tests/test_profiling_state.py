"""`profiling.forward_state.state.preserved_state`: every buffer comes back as the object it was, with its shape and
values, whatever the forward did to it (resized, rebound, counted), and one failing item neither
stops the others nor goes unnamed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lightning_ckpt
from lightning_ckpt.profiling.forward_state.state import StateRestoreError, preserved_state


class StatefulBlock(nn.Module):
    """A forward that resizes a buffer, rebinds another, counts in a third and caches a tensor."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("seen", torch.zeros(0))
        self.register_buffer("ema", torch.zeros(width))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.cached = torch.ones(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.resize_(x.shape[-1]).copy_(x.detach().mean(0))
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        self.count += 1
        self.cached = x.detach().sum()
        return self.lin(x).relu()


def _qat_model(channels: int = 8) -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * 6 * 6, 4),
    )
    model.train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    return torch.ao.quantization.prepare_qat(model)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_buffers())


def _assert_same_buffers(model: nn.Module, objects: dict, values: dict) -> None:
    now = _buffers(model)
    assert now.keys() == objects.keys()
    for name, buf in now.items():
        assert buf is objects[name], name
        assert buf.shape == values[name].shape, name
        assert torch.equal(buf, values[name]), name


def test_resized_rebound_and_counted_buffers_come_back_as_they_were():
    model = nn.Sequential(StatefulBlock(), StatefulBlock())
    objects = _buffers(model)
    values = {k: v.clone() for k, v in objects.items()}
    cached = [b.cached for b in model]
    with preserved_state(model):
        model(torch.randn(3, 4)).sum().backward()
        assert model[0].seen.shape == (4,) and model[0].ema is not objects["0.ema"]  # the forward did change them
    _assert_same_buffers(model, objects, values)
    assert all(b.cached is c for b, c in zip(model, cached))


def test_qat_observers_resized_in_forward_come_back_empty():
    model = _qat_model()
    objects = _buffers(model)
    values = {k: v.clone() for k, v in objects.items()}
    assert any(v.numel() == 0 for v in values.values())  # per-channel min/max start as [0]
    with preserved_state(model):
        model(torch.randn(2, 3, 6, 6)).sum().backward()
        assert any(objects[k].shape != values[k].shape for k in objects)
    _assert_same_buffers(model, objects, values)


class _Refusing(torch.Tensor):
    """A buffer whose restore fails (a tensor subclass that refuses to be written back)."""

    def copy_(self, *args, **kwargs):
        raise RuntimeError("this buffer refuses copy_")


def test_one_failing_restore_still_restores_the_rest_and_names_it():
    model = nn.Sequential(StatefulBlock(), StatefulBlock())
    model[1].register_buffer("count", torch.zeros((), dtype=torch.long).as_subclass(_Refusing))
    objects = _buffers(model)
    values = {k: v.clone() for k, v in objects.items()}
    with pytest.raises(StateRestoreError, match=r"could not put 1 item\(s\).*1\.count \(RuntimeError: this buffer "
                                                r"refuses copy_\).*The others were restored"):
        with preserved_state(model):
            model(torch.randn(3, 4)).sum().backward()
    for name in objects:
        assert _buffers(model)[name] is objects[name]
        if name != "1.count":
            assert torch.equal(objects[name], values[name]), name
    assert int(model[1].count) == 1  # the one that refused is left as the forward wrote it


def test_python_attributes_and_lists_come_back():
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls, self.losses, self.notes = 0, [], {}

        def forward(self, x):
            self.calls += 1
            self.losses.append(x.sum())
            self.notes["last"] = x
            return x * 2

    block = Counting()
    losses, notes = block.losses, block.notes
    with preserved_state(block):
        block(torch.ones(2))
    assert block.calls == 0 and block.losses is losses and losses == [] and block.notes is notes and notes == {}


def test_profiling_a_qat_model_leaves_it_bit_identical_to_an_unprofiled_copy():
    torch.manual_seed(0)
    model = _qat_model()
    twin = copy.deepcopy(model)
    blocks = [model[0], model[2]]

    def step(batch):
        return model(batch).square().mean()

    lightning_ckpt.profile_model(model, blocks, step, torch.randn(8, 3, 6, 6), timing=False)
    ours, theirs = _buffers(model), _buffers(twin)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].shape == theirs[name].shape and torch.equal(ours[name], theirs[name]), name
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q) and p.grad is None, name
