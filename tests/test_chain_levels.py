"""`blocks=None` on hierarchical models: every chain `discover_chain` offers near the best coverage is
profiled and planned, and the one that recomputes least within the budget is applied (`engine.chain_levels`).
Swin, ConvNeXt, Funnel, Llava and a conditional U-Net train within the budget, bit-identically to the same
loop without the library; the choice is said in one line. Plans use the default `cost_metric="time"` with
fixed machine rates (no choice rests on a timing of this run). diffusers' own test U-Net at a tight budget:
every step within it and predicted within 1 %, by a count of live storages of the test's own
(`storage_oracle`). `pick_chain` on hand-made plans, a coarser cut of a finer chain left unplanned while
the finer one fits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from level_models import LEVEL_MODELS
from models import steps_with_peaks
from storage_oracle import LiveStorages, step_state

import lightning_ckpt.profiling.machine.rates as rates_module
from lightning_ckpt import auto_checkpoint, make_plan
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.engine.chain_levels import coarser_cut, contenders, pick_chain, plan_score
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.engine.target_plan import cost_at
from lightning_ckpt.planning.policies import InfeasibleBudgetError
from lightning_ckpt.profiling.structure.discovery import ChainChoice, discover_chain
from lightning_ckpt.profiling.memory.static_memory import static_memory

BATCH, STEPS = 8, 3
# about what a 2-core CPU measured: the plans of the `time` metric without a timing of the run
RATES = MachineRates(flop_per_s=9e10, mem_byte_per_s=6e9, rng_byte_per_s=6.6e8, segment_s=6.4e-5, op_call_s=3.2e-5)


@pytest.fixture
def fixed_rates(monkeypatch):
    """The machine rates every profile takes."""
    monkeypatch.setattr(rates_module, "kept_rates", lambda *args, **kwargs: RATES)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _budget(choice: ChainChoice, model, loss, batch, share: float) -> int:
    """`share` of the way from `full`'s predicted peak to `none`'s, over the chain `choice`."""
    profile = profile_model(model, list(choice.modules), loss, batch, names=list(choice.names), timing=False)
    cost = cost_at(profile, BATCH, static_memory(model, [_optimizer(model)]))
    full, none = (make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
    return int(full + share * (none - full))


@pytest.mark.parametrize(("name", "share"), [("swin", 0.2), ("convnext", 0.2), ("funnel", 0.3), ("llava", 0.3),
                                             ("unet_conditional", 0.1)])
def test_blocks_none_plans_the_level_that_recomputes_least_within_budget(fixed_rates, name, share):
    model, loss, make_batch = LEVEL_MODELS[name]()
    batches = [make_batch(BATCH, seed) for seed in range(STEPS)]
    choice = discover_chain(model, loss, batches[0])
    budget = _budget(choice, model, loss, batches[0], share)
    plain, plain_loss, _ = LEVEL_MODELS[name]()
    reference, _ = steps_with_peaks(plain, plain_loss, batches)
    model, loss, _ = LEVEL_MODELS[name]()
    said: list[str] = []
    with auto_checkpoint(model, budget, example_batch=batches[0], step_fn=loss, optimizer=_optimizer(model),
                         verbose=False, info=said.append) as handle:
        losses, peaks = steps_with_peaks(model, loss, batches, handle)
        plan, names = handle.plan, handle.block_names
    found = contenders(choice)
    chose = [line for line in said if "blocks=None: planning over" in line]
    if len(found) > 1:  # several levels planned: one line names the chosen and what the others cost
        assert len(chose) == 1 and all(c.level in chose[0] for c in found)
    assert tuple(names) in {c.names for c in found}
    if name == "unet_conditional":  # its five top-level blocks are runs of the finest chain's: not planned
        top = next(c for c in found if len(c.names) == 5)
        assert f"{top.level} (5 blocks, down_blocks.0..up_blocks.1) is not planned" in chose[0]
        assert len(names) > 5
    assert plan.fits and plan.checkpointed and max(peaks) <= budget
    assert all(torch.equal(a, b) for a, b in zip(losses, reference))


def _lightning_steps(model, loss, batches, optimizer, handle=None) -> list[tuple[int, object]]:
    """Steps in Lightning's order (forward, `zero_grad`, backward, optimizer step: last step's gradients alive in
    the forward), each's peak by `LiveStorages` from what it finds alive -> (peak, start, plan) per step."""
    out = []
    for batch in batches:
        plan = None if handle is None else handle.step(batch)
        with LiveStorages() as mode:
            mode.count(step_state(model, optimizer) + list(batch))
            start = mode.bytes
            value = loss(batch)
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
        out.append((mode.peak, start, plan))
    return out


@pytest.mark.parametrize("share", [0.3, 0.5])
def test_blocks_none_on_diffusers_test_unet_stays_within_a_tight_budget_as_predicted(fixed_rates, share):
    """Budget: what a step finds alive (state, last step's gradients, the batch) + `share` of the unplanned step's
    activation peak, by the oracle. The chain taken runs down to each attention's norm, proj_in, transformer block
    and proj_out; a plan keeping the last transformer block and proj_out peaks in the head, where the transformer
    block's output is still held beside proj_out's (counted as carried, `lifetimes.is_local`)."""
    model, loss, make_batch = LEVEL_MODELS["small_unet_conditional"]()
    batches = [make_batch(2, seed) for seed in range(STEPS)]
    peak, start, _ = _lightning_steps(model, loss, batches, _optimizer(model))[-1]
    budget = int(start + share * (peak - start))
    model, loss, _ = LEVEL_MODELS["small_unet_conditional"]()
    optimizer = _optimizer(model)
    handle = auto_checkpoint(model, budget, example_batch=batches[0], step_fn=loss, optimizer=optimizer,
                             verbose=False, info=lambda m: None)
    try:
        steps = _lightning_steps(model, loss, batches, optimizer, handle)
    finally:
        handle.remove()
    for measured, _, plan in steps[1:]:  # from the second step on: AdamW's state and the gradients exist
        predicted = plan.predicted_peak_bytes
        assert plan.cost_metric == "time" and plan.checkpointed
        assert measured <= budget, f"measured {measured} over the budget {budget} ({plan.segments})"
        assert abs(measured - predicted) <= 0.01 * measured, f"predicted {predicted}, measured {measured} ({plan.segments})"


def _plan(recompute_s: float, fits: bool = True, batch: int = 8):
    from lightning_ckpt.planning.plan import Plan

    fields = {f.name: None for f in dataclasses.fields(Plan) if f.default is dataclasses.MISSING}
    fields.update(policy="optimal", batch_size=batch, segments=(), predicted_peak_bytes=10 if fits else 30,
                  peak_phase="forward", budget_bytes=20, static_bytes=0, recompute_flops=int(recompute_s * 1e9),
                  recompute_ms=recompute_s * 1e3, step_flops=1, rows=())
    return Plan(**fields, cost_metric="time", recompute_est_ms=recompute_s * 1e3)


def _chain(level: str, covered: int) -> ChainChoice:
    return ChainChoice(names=(level,), modules=(torch.nn.Linear(1, 1),), covered_bytes=covered, step_bytes=100,
                       left_out=(), probe_batch_size=2, level=level)


def test_pick_chain_plans_the_contenders_and_takes_the_least_recompute():
    coarse, fine, poor = _chain("stages", 98), _chain("blocks", 98), _chain("layers", 50)
    choice = dataclasses.replace(fine, alternatives=(coarse, poor))
    assert [c.level for c in contenders(choice)] == ["blocks", "stages"]  # 50 % covered: not planned
    plans = {"blocks": _plan(0.002), "stages": _plan(0.001)}
    index, line = pick_chain(choice, lambda c: plans[c.level], 8)
    assert index == 1 and line.startswith("blocks=None: planning over stages") and "blocks (1 blocks" in line
    assert plan_score(plans["stages"]).recompute_cost == pytest.approx(0.001)

    def refuse_stages(c):
        if c.level == "stages":
            raise InfeasibleBudgetError("target_batch_size=8 cannot fit")
        return plans[c.level]

    index, line = pick_chain(choice, refuse_stages, 8)
    assert index == 0 and "stages (1 blocks, stages..stages) cannot fit batch 8" in line
    with pytest.raises(InfeasibleBudgetError, match=r"cannot fit \(planned over blocks .*; stages .* cannot either\)"):
        pick_chain(choice, lambda c: (_ for _ in ()).throw(InfeasibleBudgetError("target_batch_size=8 cannot fit")), 8)


def _stages() -> tuple[ChainChoice, ChainChoice]:
    """(stages, blocks): two stages of two linear blocks each, the blocks saving 1..4 B."""
    stages = [torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)) for _ in range(2)]
    blocks = [b for s in stages for b in s]
    fine = ChainChoice(names=tuple("abcd"), modules=tuple(blocks), covered_bytes=10, step_bytes=10, left_out=(),
                       probe_batch_size=2, level="blocks", call_index=(0,) * 4, entry_saved_bytes=(1, 2, 3, 4))
    coarse = ChainChoice(names=("s0", "s1"), modules=tuple(stages), covered_bytes=10, step_bytes=10, left_out=(),
                         probe_batch_size=2, level="stages", call_index=(0, 0), entry_saved_bytes=(3, 7))
    return coarse, fine


def test_a_coarser_cut_is_planned_only_when_the_finer_chain_does_not_fit():
    coarse, fine = _stages()
    assert coarser_cut(coarse, fine) and not coarser_cut(fine, coarse)
    assert not coarser_cut(dataclasses.replace(coarse, entry_saved_bytes=(4, 7)), fine)  # the stage's own code saves
    assert not coarser_cut(coarse, dataclasses.replace(fine, modules=fine.modules[1:] + fine.modules[:1]))
    assert not coarser_cut(coarse, dataclasses.replace(fine, call_index=(0, 0, 0, 1)))  # a module called twice
    choice = dataclasses.replace(fine, alternatives=(coarse,))
    asked: list[str] = []

    def plan(c):
        asked.append(c.level)
        return _plan(0.002 if c.level == "blocks" else 0.001)

    index, line = pick_chain(choice, plan, 8, skip_coarser=True)
    assert index == 0 and asked == ["blocks"]
    assert line.endswith("stages (2 blocks, s0..s1) is not planned: each of its blocks is a run of those of blocks "
                         "(4 blocks, a..d), whose plans include its own.")
    asked.clear()
    assert pick_chain(choice, plan, 8)[0] == 1 and asked == ["blocks", "stages"]  # without: both planned
    asked.clear()

    def blocks_refused(c):
        asked.append(c.level)
        if c.level == "blocks":
            raise InfeasibleBudgetError("target_batch_size=8 cannot fit")
        return _plan(0.001)

    index, line = pick_chain(choice, blocks_refused, 8, skip_coarser=True)
    assert index == 1 and asked == ["blocks", "stages"] and "blocks (4 blocks, a..d) cannot fit batch 8" in line


def test_a_chain_that_saves_nothing_is_refused_with_its_bytes():
    """Reformer's reversible layers save 0 B for backward: checkpointing them cannot help, said before any step."""
    model, loss, make_batch = LEVEL_MODELS["reformer"]()
    with pytest.raises(ValueError, match=r"hold 0 B of the .* the step saves for backward .* cannot lower memory"):
        auto_checkpoint(model, "1GiB", example_batch=make_batch(4, 0), step_fn=loss, optimizer=_optimizer(model),
                        verbose=False, info=lambda m: None)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
