"""The engine under every front end: prepare the model, profile, plan per batch shape (on rank 0),
apply, switch plans, undo.

Plain torch (no Lightning): the callback, `auto_checkpoint` and Fabric loops drive it through
a small `StepDriver` each.
"""

from lightning_ckpt.engine import arguments
from lightning_ckpt.engine.checkpoint_engine import CheckpointEngine, EngineSettings, StepDriver
from lightning_ckpt.engine.shape_plans import ShapeDecision
from lightning_ckpt.planning.policies import POLICIES
from lightning_ckpt.profiling.structure.shapes import BatchShape

__all__ = ["POLICIES", "BatchShape", "CheckpointEngine", "EngineSettings", "ShapeDecision", "StepDriver", "arguments"]
