"""Batch shapes and profiles across the ranks of a multi-process fit.

Each rank's loader gives it its own batches; with dynamic padding their lengths differ. Every rank
must apply the same plan (sharded parameters are gathered collectively in a recompute), so the ranks
agree on the shapes of the step at every batch start: one small `all_gather_object` when there is more
than one process, nothing otherwise.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_ckpt.planning.linear_fit import Profile
from lightning_ckpt.profiling.shapes import BatchShape


def _distributed(trainer: pl.Trainer) -> bool:
    return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()


def gather(trainer: pl.Trainer, shape: BatchShape) -> list[BatchShape]:
    """Every rank's batch shape, in rank order (just this one on a single process)."""
    if not _distributed(trainer):
        return [shape]
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, shape)
    return shapes


def exchange(trainer: pl.Trainer, shape: BatchShape, profile: Profile | None) -> list[tuple[BatchShape, dict]]:
    """(shape, profile as a dict) of every rank that profiled, in rank order."""
    mine = (shape, None if profile is None else profile.to_dict())
    if not _distributed(trainer):
        return [] if profile is None else [mine]  # type: ignore[list-item]
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return [(s, p) for s, p in found if p is not None]
