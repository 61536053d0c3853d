"""The argument checks of the callback and `auto_checkpoint`: the memory budget's default (on CUDA a share of
the memory free at fit start, on CPU required), max_levels, and every argument wrong in type or value."""

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


# Every argument of the callback and of `auto_checkpoint`, wrong in type or value: refused when built,
# by name, with what was received (its repr) and what to give instead.
_SHARED_CASES = [
    ({"target_batch_size": True}, r"^target_batch_size=True must be a positive integer; .* or 'max'"),
    ({"target_batch_size": "8"}, r"^target_batch_size='8' must be a positive integer; .* or 'max'"),
    ({"target_batch_size": 0}, r"^target_batch_size=0 must be a positive integer"),
    ({"target_batch_size": 8.0}, r"^target_batch_size=8\.0 must be a positive integer"),
    ({"memory_budget": 2**80}, r"^memory_budget=1208925819614629174706176 is .* more than the 1 PiB"),
    ({"memory_budget": "1e30"}, r"^memory_budget='1e30' is .* more than the 1 PiB .* give e\.g\. '80GiB'"),
    ({"memory_budget": 3.7}, r"^memory_budget=3\.7 is not a whole number of bytes; give bytes as an int"),
    ({"memory_budget": "-5MiB"}, r"^memory_budget='-5MiB' is negative; .* e\.g\. '5MiB'"),
    ({"memory_budget": "\uff15GiB"}, r"^memory_budget='５GiB' contains .* only ASCII digits 0-9 .* write '5GiB'"),
    ({"blocks": 42}, r"^blocks=42 must be a dotted path such as 'encoder\.layers', or None"),
    ({"blocks": []}, r"^blocks=\[\] must list non-empty dotted paths or glob patterns, e\.g\. \['stem'"),
    ({"blocks": ["stem", 3]}, r"^blocks=\['stem', 3\] must list non-empty dotted paths"),
    ({"policy": "fastest"}, r"^policy='fastest' is not a known policy; choose one of none, full, every_k"),
    ({"policy": None}, r"^policy=None is not a known policy; choose one of"),
    ({"policy": "every_k", "every_k": 0}, r"^every_k=0 must be a positive integer; it is the number of blocks"),
    ({"policy": "every_k", "every_k": True}, r"^every_k=True must be a positive integer"),
    ({"every_k": 2}, r"^every_k=2 only applies to policy='every_k', but policy='optimal'; drop every_k or set"),
    ({"cost_metric": "seconds"}, r"^cost_metric='seconds' is not known; choose 'flops' .* 'ms' .* 'time'"),
    ({"granularity": "layer"}, r"^granularity='layer' is not known; choose 'block' .* or 'op'"),
    ({"granularity": "op", "policy": "greedy"}, r"^granularity='op' is planned by policy='optimal' only .* set"),
    ({"max_levels": 0}, r"^max_levels=0 must be a positive integer; it is how deep"),
    ({"target_batch_size": "max", "batch_multiple": 0}, r"^batch_multiple=0 must be a positive integer; the 'max'"),
    ({"target_batch_size": "max", "batch_multiple": "8"}, r"^batch_multiple='8' must be a positive integer"),
    ({"batch_multiple": 8}, r"^batch_multiple=8 only applies to target_batch_size='max'.*; drop batch_multiple"),
    ({"probe_batch_sizes": 3}, r"^probe_batch_sizes=3 has type int, not a pair of batch sizes; .* e\.g\. \(1, 2\)"),
    ({"probe_batch_sizes": "12"}, r"^probe_batch_sizes='12' has type str, not a pair of batch sizes"),
    ({"probe_batch_sizes": (1, 2, 4)}, r"^probe_batch_sizes=\(1, 2, 4\) has 3 sizes; give exactly two .* \(1, 2\)"),
    ({"probe_batch_sizes": [2]}, r"^probe_batch_sizes=\[2\] has 1 sizes; give exactly two"),
    ({"probe_batch_sizes": (True, 2)}, r"^probe_batch_sizes=True must be a positive integer; .* e\.g\. \(1, 2\)"),
    ({"probe_batch_sizes": (1.0, 2)}, r"^probe_batch_sizes=1\.0 must be a positive integer"),
    ({"probe_batch_sizes": (1, "2")}, r"^probe_batch_sizes='2' must be a positive integer"),
    ({"probe_batch_sizes": (-1, 2)}, r"^probe_batch_sizes=-1 must be a positive integer"),
    ({"probe_batch_sizes": (2, 2)}, r"^probe_batch_sizes=\(2, 2\) gives the same size twice; give two different .* e\.g\. \(1, 2\)"),
    ({"check_batch_size": 0}, r"^check_batch_size=0 must be a positive integer; or None to skip"),
    ({"check_batch_size": True}, r"^check_batch_size=True must be a positive integer"),
    ({"check_batch_size": "4"}, r"^check_batch_size='4' must be a positive integer"),
    ({"guard_batchnorm": "false"}, r"^guard_batchnorm='false' has type str, not bool; give True or False"),
    ({"guard_batchnorm": None}, r"^guard_batchnorm=None has type NoneType, not bool; give True or False"),
    ({"verbose": 1}, r"^verbose=1 has type int, not bool; give True or False"),
    ({"keep_hf_checkpointing": "yes"}, r"^keep_hf_checkpointing='yes' has type str, not bool"),
]
_CALLBACK_CASES = [
    ({"batch_arg_name": ""}, r"^batch_arg_name='' must be a non-empty string; the attribute that holds"),
    ({"batch_arg_name": 3}, r"^batch_arg_name=3 must be a non-empty string"),
    ({"strict_resume": "no"}, r"^strict_resume='no' has type str, not bool; give True or False"),
    ({"measure_peak": "yes"}, r"^measure_peak='yes' has type str, not bool; give True or False"),
    ({"measure_peak": None}, r"^measure_peak=None has type NoneType, not bool; give True or False"),
    ({"report": 0}, r"^report=0 has type int, not bool; give True or False"),
    ({"plan_only": "true"}, r"^plan_only='true' has type str, not bool"),
    ({"tune_allocator": 1}, r"^tune_allocator=1 has type int, not bool; give True, False or None"),
]
_LOOP_CASES = [
    ({"model": 42}, TypeError, r"^model=42 has type int, not torch\.nn\.Module; pass the module you train"),
    ({"step_fn": 3}, TypeError, r"^step_fn=3 is not callable; pass a function batch -> loss"),
    ({"info": "print"}, TypeError, r"^info='print' is not callable; pass a function that takes a message"),
    ({"optimizer": "adam"}, TypeError, r"^optimizer=str is not a torch\.optim\.Optimizer"),
    ({"optimizer_state_bytes": -1}, ValueError, r"^optimizer_state_bytes=-1 must be a whole number of bytes, 0 or"),
    ({"optimizer_state_bytes": True}, ValueError, r"^optimizer_state_bytes=True must be a whole number of bytes"),
    ({"optimizer_state_bytes": 1.5}, ValueError, r"^optimizer_state_bytes=1\.5 must be a whole number of bytes"),
    ({"accumulate_grad_batches": 0}, ValueError, r"^accumulate_grad_batches=0 must be a positive integer"),
    ({"check_shapes": "no"}, ValueError, r"^check_shapes='no' has type str, not bool; give True or False"),
]


@pytest.mark.parametrize(("kwargs", "match"), _SHARED_CASES + _CALLBACK_CASES)
def test_callback_refuses_each_bad_argument_when_built(kwargs, match):
    from lightning_ckpt import ActivationCheckpointing

    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(**{"target_batch_size": 8, "memory_budget": "1GiB", **kwargs})


def _loop_arguments() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.randn(8, 4)
    return {"model": model, "memory_budget": "1GiB", "example_batch": x, "step_fn": lambda b: model(b).sum(),
            "blocks": None, "verbose": False}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"), [(k, ValueError, m) for k, m in _SHARED_CASES] + _LOOP_CASES
)
def test_auto_checkpoint_refuses_each_bad_argument_before_profiling(kwargs, error, match, monkeypatch):
    from lightning_ckpt.frontends.loops import auto_checkpoint as loops

    def never(*args, **kw):  # nothing may be profiled, discovered or planned with a bad argument
        raise AssertionError("a bad argument reached the engine")

    monkeypatch.setattr(loops, "CheckpointEngine", never)
    monkeypatch.setattr(loops, "discover_chain", never)
    with pytest.raises(error, match=match):
        loops.auto_checkpoint(**{**_loop_arguments(), **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"probe_batch_sizes": (2, 1)}, (1, 2)),  # either order: the smaller is probed first
        ({"probe_batch_sizes": [2, 4], "check_batch_size": None}, (2, 4)),  # YAML gives a list
        ({"probe_batch_sizes": (1, 2), "measure_peak": False, "tune_allocator": None}, (1, 2)),
    ],
)
def test_good_arguments_are_kept(kwargs, expected):
    from lightning_ckpt import ActivationCheckpointing

    cb = ActivationCheckpointing(**{"target_batch_size": 8, "memory_budget": "1GiB", **kwargs})
    assert cb._settings["probe_batch_sizes"] == expected


def test_a_whole_float_budget_is_that_many_bytes():
    from lightning_ckpt import ActivationCheckpointing

    assert ActivationCheckpointing(target_batch_size=8, memory_budget=3.0).memory_budget == 3
