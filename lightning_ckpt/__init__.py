"""lightning-ckpt: automatic activation checkpointing for PyTorch Lightning.

Profile a training step block by block, plan which blocks to checkpoint so the
target batch size fits a memory budget with the least recompute, and apply the
plan with non-reentrant `torch.utils.checkpoint`. The core (profiler, memory model,
planner, apply, the engine) is plain torch; `auto_checkpoint` drives it from a loop
you write (plain PyTorch, Fabric); `ActivationCheckpointing` (the Lightning callback)
is imported lazily so that `import lightning_ckpt` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# in pipeline order: shared data, profiling, planning, apply, the engine, the front ends
from lightning_ckpt.units import parse_bytes
from lightning_ckpt.costs.block_costs import BlockCost, OpCost, StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.profiling.structure.blocks import resolve_blocks
from lightning_ckpt.profiling.structure.discovery import ChainChoice, discover_chain
from lightning_ckpt.profiling.machine.rates import measure_rates
from lightning_ckpt.profiling.memory.static_memory import StaticMemory, static_memory
from lightning_ckpt.profiling.memory.step_peak import measure_step_peak
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker
from lightning_ckpt.profiling.memory.zero_memory import ZeroMemory, ZeroOffload, zero_memory
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.planning.op_options import GRANULARITIES, OpOption, block_options
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import POLICIES, InfeasibleBudgetError, PartialStepWarning, make_plan
from lightning_ckpt.planning.recompute_cost import recompute_cost
from lightning_ckpt.apply.recompute_errors import explain_checkpoint_error
from lightning_ckpt.apply.segments import AppliedPlan, apply_plan, apply_segments
from lightning_ckpt.engine.checkpoint_engine import CheckpointEngine, EngineSettings, StepDriver
from lightning_ckpt.engine.model_prep import Prepared, prepare_model
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.engine.target_plan import cost_at as step_cost
from lightning_ckpt.frontends.loops.auto_checkpoint import CheckpointHandle, auto_checkpoint

if TYPE_CHECKING:
    from lightning_ckpt.frontends.lightning.callback import ActivationCheckpointing
    from lightning_ckpt.frontends.lightning.deepspeed_strategy import DeepSpeedStrategy

__all__ = [
    "ActivationCheckpointing",
    "AppliedPlan",
    "BlockCost",
    "ChainChoice",
    "CheckpointEngine",
    "CheckpointHandle",
    "DeepSpeedStrategy",
    "EngineSettings",
    "GRANULARITIES",
    "InfeasibleBudgetError",
    "LiveBytesTracker",
    "MachineRates",
    "OpCost",
    "OpOption",
    "POLICIES",
    "PartialStepWarning",
    "Prepared",
    "Plan",
    "Profile",
    "StaticMemory",
    "StepCost",
    "StepDriver",
    "ZeroMemory",
    "ZeroOffload",
    "apply_plan",
    "apply_segments",
    "auto_checkpoint",
    "block_options",
    "discover_chain",
    "explain_checkpoint_error",
    "make_plan",
    "measure_rates",
    "measure_step_peak",
    "parse_bytes",
    "predict_peak",
    "prepare_model",
    "profile_model",
    "recompute_cost",
    "resolve_blocks",
    "static_memory",
    "step_cost",
    "zero_memory",
]

_LAZY = {"ActivationCheckpointing": "lightning_ckpt.frontends.lightning.callback", "DeepSpeedStrategy": "lightning_ckpt.frontends.lightning.deepspeed_strategy"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_ckpt' has no attribute {name!r}")
