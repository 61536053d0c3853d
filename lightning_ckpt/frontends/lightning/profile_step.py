"""Profile Lightning's training step on slices of the first training batch.

The probes run the module's own `training_step` under the precision plugin's step
context, inside the strategy's profiling context and with `self.log` muted, so they
see what training sees and leave the run (metrics, gradients, DeepSpeed's state) alone;
optimizer and scheduler steps are skipped and, under manual optimization, the profiler
runs the backward that `manual_backward` is given (`held_training`).
Under sharded training every rank also measures the all-gather rate (`profiling.work.gather`); a loss
computed under `loss_parallel` is backpropagated under it (`loss_parallel`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ckpt.profiling.structure.batch import checked_size
from lightning_ckpt.frontends.lightning.compiled import compiled_by, eager_only, one_block_profile
from lightning_ckpt.frontends.lightning.held_training import held_training
from lightning_ckpt.frontends.lightning.loss_parallel import held_loss_parallel
from lightning_ckpt.frontends.lightning.muted_logging import muted_logging
from lightning_ckpt.frontends.lightning.strategy_hooks import profiling_context
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.profiling.structure.batch import batch_size_of, slice_batch
from lightning_ckpt.profiling.structure.block_calls import call_chain
from lightning_ckpt.profiling.structure.discovery import ChainChoice, discover_chain
from lightning_ckpt.profiling.work.gather import with_recompute_gather
from lightning_ckpt.profiling.passes.profile_budget import ProfileBudget, SliceRoom
from lightning_ckpt.engine.step_profile import profile_model

LINEAR_FIT_TOLERANCE = 0.05  # relative miss at the check size above which the fitted line is reported


def probe_sizes(batch: Any, probes: tuple[int, int], check: int | None) -> int | None:
    """Check the probe sizes against the batch they slice; -> the check size to use (None: skip it)."""
    return checked_size(batch, probes, check, rank_zero_info, "the first training batch")


def _training_step(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int):
    def step_fn(b: Any) -> torch.Tensor:
        with muted_logging(pl_module), trainer.precision_plugin.train_step_context():
            return pl_module.training_step(b, batch_idx)

    return step_fn


def profile_first_batch(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    blocks: list[torch.nn.Module],
    names: list[str],
    batch: Any,
    batch_idx: int,
    probes: tuple[int, int],
    check: int | None,
    calibrate_keeps: bool = False,
    rates: MachineRates | None = None,
    time_blocks: bool = True,
    budget: ProfileBudget | None = None,
) -> Profile:
    """Profile the blocks at the probe sizes (and the check size) on slices of `batch`;
    `calibrate_keeps` (op-level plans in `time`) also times what keeping op outputs saves;
    `rates` measured by an earlier profile are reused (None: measured now); `time_blocks`: each
    block's forward is timed (the `ms` cost metric needs it); `budget`: every pass within it
    (`profiling.passes.profile_budget`)."""
    check = probe_sizes(batch, probes, check)
    step_fn = _training_step(trainer, pl_module, batch_idx)
    # optimizers, schedulers and counters held still; a manual step's backward is run by the profiler
    with held_training(trainer, pl_module, step_fn) as step:
        # a compiled model is profiled as its original code; a loss under `loss_parallel` backpropagated as in training
        with profiling_context(trainer), eager_only(), held_loss_parallel():
            profile = profile_model(pl_module, blocks, step, batch, probes, check, names=names, calibrate_keeps=calibrate_keeps, rates=rates,
                                    time_blocks=time_blocks, budget=budget)
        profile = one_block_profile(profile, compiled_by(pl_module, blocks))  # compiled: one block per region
        profile = with_recompute_gather(profile, blocks)  # sharded blocks: what their recompute gathers, and how fast
    if profile.fit_note:  # the smallest slices were left out: they were off the line through the larger ones
        rank_zero_info(f"lightning-ckpt: {profile.fit_note}.")
    err = profile.check_error()
    if err > LINEAR_FIT_TOLERANCE:
        a, b = (p.batch_size for p in profile.probes)
        rank_zero_warn(
            f"lightning-ckpt: memory predicted from batches {a} and {b} misses the measurement at batch "
            f"{profile.check.batch_size} by {100 * err:.1f}%"
            + (" even after leaving out the smaller slices" if profile.fit_note else "")
            + "; this model's memory is not linear in the batch size, so the plan may be off. Profile on larger "
            "slices (e.g. probe_batch_sizes=(4, 8), check_batch_size=16) or leave the budget more room."
        )
    return profile


def chain_of_first_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, room: SliceRoom | None = None,
) -> ChainChoice:
    """With ``blocks=None``: the chain that covers most of the bytes the training step saves
    (`profiling.structure.discovery`), measured by one forward on a slice of `batch` (within `room`), every state held."""
    step_fn = _training_step(trainer, pl_module, 0)
    with held_training(trainer, pl_module, step_fn) as step:
        with profiling_context(trainer), eager_only():
            return discover_chain(pl_module, step, batch, room=room)


def calls_of_first_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, modules: list[torch.nn.Module], names: list[str], batch: Any
) -> tuple[list[torch.nn.Module], list[str]]:
    """The chain of calls the training step makes of `modules` (`profiling.structure.block_calls`), read by one
    forward on two samples of `batch` (one BatchNorm cannot train on one), every state held."""
    step_fn = _training_step(trainer, pl_module, 0)
    with held_training(trainer, pl_module, step_fn) as step:
        with profiling_context(trainer), eager_only():
            return call_chain(pl_module, modules, names, step, slice_batch(batch, min(2, batch_size_of(batch))))
