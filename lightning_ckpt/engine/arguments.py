"""Checks of `ActivationCheckpointing`'s arguments, with messages that say what to do.

Values are checked when the callback is built (`__init__`), so a bad YAML config fails
before any training; the memory budget's default depends on the device, and the host budget's
on the machine and its ranks, so both are resolved in `setup`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_ckpt.planning.op_options import GRANULARITIES
from lightning_ckpt.planning.policies import POLICIES
from lightning_ckpt.planning.recompute_cost import COST_METRICS
from lightning_ckpt.profiling.memory.rss import available_host_bytes

DEFAULT_CUDA_FRACTION = 0.9  # the default budget on CUDA: this share of the memory free at fit start
# the default host budget: this share of the host memory available at fit start, split between the local ranks
DEFAULT_HOST_FRACTION = 0.8


def positive_int(value: Any, name: str, hint: str) -> int:
    """`value` when it is a positive int (not a bool), else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; {hint}")
    return value


def check_flags(optional: tuple[str, ...] = (), **flags: Any) -> None:
    """Each of `flags` is True or False (None too when its name is in `optional`), else ValueError:
    a string such as 'false' from a config would otherwise count as True."""
    for name, value in flags.items():
        if isinstance(value, bool) or value is None and name in optional:
            continue
        allowed = "True, False or None" if name in optional else "True or False"
        raise ValueError(
            f"{name}={value!r} has type {type(value).__name__}, not bool; give {allowed} (a string such as "
            "'false' would read as true)."
        )


def check_name(value: Any, name: str, hint: str) -> str:
    """`value` when it is a non-empty string, else ValueError naming `name`."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}={value!r} must be a non-empty string; {hint}")
    return value


def check_target(target_batch_size: Any, batch_multiple: Any) -> None:
    if target_batch_size != "max":
        positive_int(target_batch_size, "target_batch_size", "it is the per-device batch size to train at, or 'max'.")
    positive_int(batch_multiple, "batch_multiple", "the 'max' batch is rounded down to a multiple of it.")
    if batch_multiple != 1 and target_batch_size != "max":
        raise ValueError(
            f"batch_multiple={batch_multiple} only applies to target_batch_size='max', but target_batch_size="
            f"{target_batch_size!r}; drop batch_multiple or set target_batch_size='max'."
        )


def check_policy(policy: Any, every_k: Any, cost_metric: Any, granularity: Any = "block", max_levels: Any = 2) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not a known policy; choose one of {', '.join(POLICIES)}.")
    if every_k is not None:
        positive_int(every_k, "every_k", "it is the number of blocks per checkpointed segment.")
        if policy != "every_k":
            raise ValueError(
                f"every_k={every_k} only applies to policy='every_k', but policy={policy!r}; drop every_k or set "
                "policy='every_k'."
            )
    if cost_metric not in COST_METRICS:
        raise ValueError(
            f"cost_metric={cost_metric!r} is not known; choose 'flops' (counted FLOPs, deterministic), "
            "'ms' (forward timed once per block) or 'time' (estimated from FLOPs and bytes at measured rates)."
        )
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity={granularity!r} is not known; choose 'block' (checkpoint whole blocks) or 'op' (a block "
            "checkpointed alone may also keep some of its op outputs: selective checkpointing)."
        )
    if granularity == "op" and policy != "optimal":
        raise ValueError(
            f"granularity='op' is planned by policy='optimal' only (it chooses the op outputs to keep), but "
            f"policy={policy!r}; set policy='optimal' or granularity='block'."
        )
    positive_int(
        max_levels, "max_levels",
        "it is how deep policy='optimal' may nest segments (1: single-level; 2: a segment's recompute may "
        "checkpoint inner segments; 3: those may nest once more).",
    )


def check_allow_python_state(value: Any) -> bool | tuple[str, ...]:
    """`allow_python_state` as the engine keeps it: True, False or a tuple of block names."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v.strip() for v in value):
        return tuple(value)
    raise ValueError(
        f"allow_python_state={value!r} must be True, False or a list of block names (e.g. ['layers.3']); it lets "
        "blocks whose forward writes Python state (a counter, a list, random draws) be checkpointed, which is "
        "safe only when repeating that write in a recompute is harmless."
    )


def check_blocks(blocks: Any) -> str | list[str] | None:
    """`blocks` as the callback keeps it: a dotted path, a list of paths or patterns, or None."""
    if isinstance(blocks, (list, tuple)):
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, str) and b.strip() for b in blocks):
            raise ValueError(
                f"blocks={blocks!r} must list non-empty dotted paths or glob patterns, e.g. ['stem', 'layer1.*']."
            )
    elif blocks is not None and (not isinstance(blocks, str) or not blocks.strip()):
        raise ValueError(f"blocks={blocks!r} must be a dotted path such as 'encoder.layers', or None to auto-detect.")
    return blocks


def check_probes(probe_batch_sizes: Any, check_batch_size: Any) -> tuple[int, int]:
    """The two probe sizes as a tuple, smaller first; the check size is a positive int or None."""
    example = "e.g. (1, 2), or (2, 4) when a BatchNorm normalises pooled (batch, channels) features"
    if isinstance(probe_batch_sizes, (str, bytes)) or not isinstance(probe_batch_sizes, Sequence):
        raise ValueError(
            f"probe_batch_sizes={probe_batch_sizes!r} has type {type(probe_batch_sizes).__name__}, not a pair of "
            f"batch sizes; give two different positive integers, {example}."
        )
    probes = tuple(probe_batch_sizes)
    if len(probes) != 2:
        raise ValueError(
            f"probe_batch_sizes={probe_batch_sizes!r} has {len(probes)} sizes; give exactly two different positive "
            f"integers (bytes are fitted as a line through them), {example}."
        )
    for p in probes:
        positive_int(p, "probe_batch_sizes", f"probes are small slices of a real batch: give two, {example}.")
    if probes[0] == probes[1]:
        raise ValueError(
            f"probe_batch_sizes={probe_batch_sizes!r} gives the same size twice; give two different positive "
            f"integers (a line needs two batch sizes), {example}."
        )
    if check_batch_size is not None:
        positive_int(check_batch_size, "check_batch_size", "or None to skip the check of the fitted line.")
    return (min(probes), max(probes))


def resolve_budget(memory_budget: int | None, device: torch.device) -> int:
    """The budget given, or on CUDA `DEFAULT_CUDA_FRACTION` of the memory free at fit start."""
    if memory_budget is not None:
        return memory_budget
    if device.type == "cuda":
        return cuda_default_budget(device)
    raise ValueError(
        f"memory_budget was not given and the training device is {device.type!r}: only on CUDA can "
        "lightning-ckpt read the device's memory size. Set memory_budget (bytes or e.g. '8GiB') to the "
        "per-device peak you allow for the whole training step."
    )


def cuda_default_budget(device: torch.device) -> int:
    """`DEFAULT_CUDA_FRACTION` of what this process can use on `device` now: the driver's free
    memory plus what torch's caching allocator already holds here (reusable by the step), not
    the card's total, which other processes and the CUDA context also take from."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    return int(DEFAULT_CUDA_FRACTION * (free_bytes + torch.cuda.memory_reserved(device)))


def resolve_host_budget(host_memory_budget: int | None, local_ranks: int) -> int | None:
    """The per-rank host budget for what a strategy offloads: the one given, else `DEFAULT_HOST_FRACTION`
    of the host memory available now divided by the ranks on this machine; None where that is unknown."""
    if host_memory_budget is not None:
        return host_memory_budget
    available = available_host_bytes()
    return None if available is None else int(DEFAULT_HOST_FRACTION * available) // max(1, local_ranks)
