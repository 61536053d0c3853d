"""The callback's argument checks: the memory budget's default (on CUDA a share of the memory free at fit
start, on CPU required) and max_levels."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_ckpt.engine import arguments


def test_cpu_without_a_budget_says_to_set_one():
    with pytest.raises(ValueError, match="memory_budget was not given and the training device is 'cpu'"):
        arguments.resolve_budget(None, torch.device("cpu"))
    assert arguments.resolve_budget(123, torch.device("cpu")) == 123


def test_cuda_default_is_90_percent_of_free_plus_this_process_cache(monkeypatch):
    """Free memory, not the card's total: another process holding 60 of 80 GiB leaves 20 GiB."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (18 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * gib)
    assert arguments.resolve_budget(None, torch.device("cuda", 0)) == int(0.9 * 20 * gib)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_is_below_the_free_memory():
    device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    assert 0 < arguments.resolve_budget(None, device) <= free + torch.cuda.memory_reserved(device) < total + 1


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_max_levels_must_be_a_positive_int(value):
    """Zero, negatives, floats, strings and bools (True is an int to Python) are refused, by name."""
    from lightning_ckpt import ActivationCheckpointing

    with pytest.raises(ValueError, match=re.escape(f"max_levels={value!r} must be a positive integer; it is how deep")):
        arguments.check_policy("optimal", None, "time", "block", value)
    with pytest.raises(ValueError, match=re.escape(f"max_levels={value!r} must be a positive integer")):
        ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", max_levels=value)


@pytest.mark.parametrize("value", [1, 2, 3])
def test_max_levels_positive_ints_are_accepted(value):
    from lightning_ckpt import ActivationCheckpointing

    arguments.check_policy("optimal", None, "time", "block", value)
    assert ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", max_levels=value).max_levels == value
