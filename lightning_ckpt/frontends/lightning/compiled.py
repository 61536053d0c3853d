"""The callback with `torch.compile`: `trainer.fit(torch.compile(module))` (Lightning compiles
`forward` and `training_step`) or a compiled submodule (`self.net = torch.compile(net)`).

Profiling runs without dynamo (`eager_only`), the plan uses one-block segments (the form compiled
code runs) and is applied with `apply_compiled`'s traced regions; uncompiled models keep the hooks.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ckpt.apply.segments import AppliedPlan, apply_segments
from lightning_ckpt.apply.compiled import apply_compiled_segments, compiled_modules, eager_only
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.plan import Plan

__all__ = ["apply_plan", "compiled_by", "eager_only", "one_block_profile"]


def compiled_by(pl_module: pl.LightningModule, blocks: list[torch.nn.Module]) -> list[str]:
    """What compiles the blocks: Lightning's compiled module (`trainer.fit(torch.compile(m))`)
    and the compiled submodules around them; empty when they run eagerly."""
    found = ["trainer.fit(torch.compile(module))"] if getattr(pl_module, "_compiler_ctx", None) else []
    return found + compiled_modules(pl_module, blocks)


def one_block_profile(profile: Profile, compiled: list[str]) -> Profile:
    """The profile for a compiled model: no block chains from the previous one, so every policy
    plans segments of one block and the plan's prediction describes the regions that run."""
    if not compiled:
        return profile

    def unchained(step):  # a StepCost
        return dataclasses.replace(
            step, blocks=tuple(dataclasses.replace(b, chains_from_previous=False) for b in step.blocks)
        )

    rank_zero_info(
        f"lightning-ckpt: the blocks run compiled ({', '.join(compiled)}); each checkpointed block becomes a "
        "checkpoint region of its own inside the compiled graph, so the plan uses segments of one block."
    )
    check = None if profile.check is None else unchained(profile.check)
    return Profile(probes=(unchained(profile.probes[0]), unchained(profile.probes[1])), check=check)


def apply_plan(
    pl_module: pl.LightningModule,
    blocks: list[torch.nn.Module],
    names: list[str],
    plan: Plan,
    guard_batchnorm: bool,
) -> AppliedPlan:
    """`plan` with hook-based regions for an eager model, traced one-block regions for a compiled one."""
    segments = plan.segments
    compiled = compiled_by(pl_module, blocks)
    if not compiled:
        return apply_segments(
            blocks, segments, guard_batchnorm=guard_batchnorm, keep_ops=plan.keep_ops, inner_segments=plan.inner_segments
        )
    calls = [n for n in names if "#" in n]
    if calls:  # a compiled region is the module's forward: every call of it alike
        raise ValueError(
            f"the model is compiled ({', '.join(compiled)}) and the step calls some blocks several times "
            f"({', '.join(calls[:4])}{', ...' if len(calls) > 4 else ''}); a compiled block is checkpointed as one "
            "region for all its calls, so a plan that decides per call cannot be applied. Train the model eagerly, "
            "or name blocks=[...] that run once per step."
        )
    if plan.keeps:
        rank_zero_warn(
            f"lightning-ckpt: the plan keeps op outputs in {len(plan.keeps)} block(s) (granularity='op'), but the "
            f"model is compiled ({', '.join(compiled)}): inside a compiled graph those blocks are checkpointed whole, "
            "which recomputes more and holds less than the plan says. Use granularity='block' with torch.compile, "
            "or train the blocks eagerly to keep op outputs."
        )
    if plan.inner_segments:  # a plan made before compiling: compiled blocks chain into no segment
        rank_zero_warn(
            f"lightning-ckpt: the plan rebuilds {len(plan.inner_segments)} inner segment(s) inside the recompute of "
            f"larger segments, but the model is compiled ({', '.join(compiled)}): compiled blocks are checkpointed "
            "one per region, so the nesting is not applied and the step holds more than the plan predicts. Plan "
            "again for the compiled model (strict_resume=False and a changed setting), or train the blocks eagerly."
        )
    if any(b > a for a, b in segments):  # a plan made before compiling (resumed from a checkpoint)
        rank_zero_info(
            f"lightning-ckpt: the plan has segments of several blocks, but the model is compiled "
            f"({', '.join(compiled)}): each of their blocks is checkpointed on its own, which keeps each block's "
            "input and so more memory than the plan predicts. Plan again (strict_resume=False and a changed "
            "setting, or without the checkpoint's callback state) to plan for the compiled model."
        )
    return apply_compiled_segments(blocks, segments, names, guard_batchnorm, warn_eager=True)
