"""lightning-ckpt: automatic activation checkpointing for PyTorch Lightning.

Profile a training step block by block, plan which blocks to checkpoint so the
target batch size fits a memory budget with the least recompute, and apply the
plan with non-reentrant `torch.utils.checkpoint`. The core (profiler, memory model,
planner, apply) is plain torch; `ActivationCheckpointing` (the Lightning callback)
is imported lazily so that `import lightning_ckpt` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_ckpt.apply import AppliedPlan, apply_segments
from lightning_ckpt.blocks import resolve_blocks
from lightning_ckpt.costs import BlockCost, MachineRates, StepCost
from lightning_ckpt.measure import measure_step_peak
from lightning_ckpt.memory_model import predict_peak, recompute_cost
from lightning_ckpt.plan import Plan
from lightning_ckpt.planner import POLICIES, InfeasibleBudgetError, make_plan
from lightning_ckpt.profile import Profile
from lightning_ckpt.profiler import profile_model
from lightning_ckpt.rates import measure_rates
from lightning_ckpt.static_memory import StaticMemory, static_memory
from lightning_ckpt.tracker import LiveBytesTracker
from lightning_ckpt.units import parse_bytes
from lightning_ckpt.zero_memory import ZeroMemory, zero_memory

if TYPE_CHECKING:
    from lightning_ckpt.callback import ActivationCheckpointing
    from lightning_ckpt.strategy import DeepSpeedStrategy

__all__ = [
    "ActivationCheckpointing",
    "AppliedPlan",
    "BlockCost",
    "DeepSpeedStrategy",
    "InfeasibleBudgetError",
    "LiveBytesTracker",
    "MachineRates",
    "POLICIES",
    "Plan",
    "Profile",
    "StaticMemory",
    "StepCost",
    "ZeroMemory",
    "apply_segments",
    "make_plan",
    "measure_rates",
    "measure_step_peak",
    "parse_bytes",
    "predict_peak",
    "profile_model",
    "recompute_cost",
    "resolve_blocks",
    "static_memory",
    "zero_memory",
]

_LAZY = {"ActivationCheckpointing": "lightning_ckpt.callback", "DeepSpeedStrategy": "lightning_ckpt.strategy"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_ckpt' has no attribute {name!r}")
