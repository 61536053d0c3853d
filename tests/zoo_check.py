"""One zoo model trained a few steps under `auto_checkpoint` at a budget between its `full` and `none`
peaks, beside the same loop without it: predicted against measured whole-step peak, the budget, and the
losses compared bit for bit. Used by `tests/test_zoo.py` and `benchmarks/zoo.py`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_ckpt import auto_checkpoint, make_plan, measure_step_peak
from lightning_ckpt.engine.target_plan import cost_at
from lightning_ckpt.engine.model_prep import prepare_model
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.profiling.structure.batch import batch_size_of
from lightning_ckpt.profiling.structure.block_calls import call_chain
from lightning_ckpt.profiling.forward_state.state import preserved_state
from lightning_ckpt.profiling.memory.static_memory import static_memory


@dataclass(frozen=True)
class ZooRow:
    model: str
    share: float  # where the budget sits between `full` (0) and `none` (1)
    budget_bytes: int
    predicted_bytes: int
    measured_bytes: int  # the largest measured step (the optimizer state exists from the second on)
    losses_same: bool
    plan: str  # what was checkpointed, in short
    growth_bytes: int  # the last step's measured peak minus the second's (0: nothing kept alive across steps)
    cost_metric: str = "time"  # what the plan weighed recompute in

    @property
    def miss(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    @property
    def fits(self) -> bool:
        return self.measured_bytes <= self.budget_bytes


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def budget_between(entry, batch, share: float) -> int:
    """`full`'s predicted peak + `share` of the way up to `none`'s, for the whole step at `batch`."""
    names, blocks = entry.blocks()
    with prepare_model(entry.model, warn=lambda m: None):
        with preserved_state(entry.model):  # a module called several times per step: one block per call
            blocks, names = call_chain(entry.model, blocks, names, entry.loss, batch)
        profile = profile_model(entry.model, blocks, entry.loss, batch, names=names, timing=False)
    n = batch_size_of(batch)
    cost = cost_at(profile, n, static_memory(entry.model, [_optimizer(entry.model)]))
    lo, hi = (make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
    return int(lo + share * (hi - lo))


def check(build: Callable[[], object], share: float, batch_size: int = 8, steps: int = 3, **kw) -> ZooRow:
    """Train `build()`'s model `steps` steps without and then with `auto_checkpoint` at the budget
    `share` of the way from `full` to `none`; `kw` goes to `auto_checkpoint`."""
    torch.manual_seed(0)
    entry = build()
    batches = [entry.batch(batch_size, seed=i) for i in range(steps)]
    budget = budget_between(entry, batches[0], share)

    def train(entry, handle=None):
        opt = _optimizer(entry.model)
        losses, peaks = [], []
        for batch in batches:
            if handle is not None:
                handle.step(batch)
            peaks.append(measure_step_peak(entry.model, entry.loss, batch, opt))
        for batch in batches:
            loss = entry.loss(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, peaks

    torch.manual_seed(0)
    plain = build()
    plain.model.train()
    with prepare_model(plain.model, warn=lambda m: None):  # the same settings (use_cache off) as under the plan
        ref_losses, _ = train(plain)
    torch.manual_seed(0)
    entry = build()
    entry.model.train()
    opt = _optimizer(entry.model)
    chain = entry.chain if isinstance(entry.chain, str) else list(entry.chain)
    handle = auto_checkpoint(
        entry.model, budget, example_batch=batches[0], step_fn=entry.loss, optimizer=opt, blocks=chain,
        verbose=False, info=lambda m: None, **kw,
    )
    try:
        losses, peaks = train(entry, handle)
        plan = handle.plan
    finally:
        handle.remove()
    return ZooRow(
        model=entry.name, share=share, budget_bytes=budget, predicted_bytes=plan.predicted_peak_bytes,
        measured_bytes=max(peaks), losses_same=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
        plan=f"{len(plan.checkpointed)}/{plan.n_blocks} in {len(plan.segments)} seg"
        + (f", {len(plan.inner_segments)} inner" if plan.inner_segments else ""),
        growth_bytes=peaks[-1] - peaks[1] if len(peaks) > 2 else 0, cost_metric=plan.cost_metric,
    )
