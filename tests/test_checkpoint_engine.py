"""`CheckpointEngine` under a driver written here: what it asks of a front end, when it plans,
applies, switches and undoes, and what a rank other than 0 does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import TinyChain, tokens_batch

from lightning_ckpt import CheckpointEngine, EngineSettings
from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.profiling.structure.blocks import resolve_blocks
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.profiling.memory.static_memory import static_memory


class Driver:
    """A single process (or, with `rank` and `shared`, one rank whose broadcast returns `shared`)."""

    def __init__(self, model, rank: int = 0, shared=None) -> None:
        self.model, self.rank, self.shared = model, rank, shared
        self.grads_accumulate = False
        self.profiled, self.applied, self.messages, self.broadcasts = [], [], [], []
        self.timed_blocks: list[bool] = []

    def profile(self, batch, blocks, names, *, batch_idx, probes, check, rates, calibrate_keeps, time_blocks=True,
                budget=None):
        self.profiled.append(tuple(batch[0].shape))
        self.timed_blocks.append(time_blocks)
        return profile_model(self.model, blocks, self.loss, batch, probes, check, names=names, timing=False, budget=budget)

    def loss(self, batch):
        return F.cross_entropy(self.model(batch[0]), batch[1])

    def static_memory(self):
        return static_memory(self.model)

    def broadcast(self, obj):
        self.broadcasts.append(obj)
        return obj if self.shared is None else self.shared

    def all_gather(self, obj):
        return [obj]

    def apply(self, blocks, names, plan, guard_batchnorm):
        self.applied.append(plan.segments)
        return apply_segments(blocks, plan.segments, guard_batchnorm=guard_batchnorm)

    def info(self, message):
        self.messages.append(message)

    warn = info


def _engine(budget: int = 10**9, policy: str = "full", rank: int = 0, shared=None, metric: str = "flops"):
    torch.manual_seed(0)
    model = TinyChain(n_blocks=4, d=16)
    _, names, blocks = resolve_blocks(model, "blocks")
    driver = Driver(model, rank, shared)
    engine = CheckpointEngine(EngineSettings(budget, policy=policy, cost_metric=metric), driver)
    engine.bind(blocks, names)
    return engine, driver


def _hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_a_shape_is_profiled_and_planned_once_and_switched_when_it_changes():
    engine, driver = _engine()
    short, long = tokens_batch(8, 12), tokens_batch(8, 20)
    first = engine.step(short)
    assert first is not None and first.new and engine.plan.segments == ((0, 0), (1, 1), (2, 2), (3, 3))
    assert engine.step(short) is None  # the applied plan is this shape's: nothing to do
    assert engine.step(long) is not None and (8, 20) in driver.profiled  # (and prefixes of it, for the fit)
    applied = len(driver.applied)  # profiling ran without the plan: it was applied again after
    again = engine.step(short)
    assert again is not None and not again.new  # cached: not profiled again, regions kept (same plan)
    assert len(driver.applied) == applied and len(engine.plans) == 2  # `full` at both: the hooks stayed as they were
    engine.remove()
    assert _hooks(driver.model) == 0 and not engine.applied


def test_a_shape_costed_from_the_fit_keeps_the_applied_regions_and_a_failed_plan_takes_them_off():
    engine, driver = _engine()
    for n in (12, 24, 16):  # profiled (24 with a prefix): lengths between are then costed from the fit
        engine.step(tokens_batch(8, n))
    profiled, applied = len(driver.profiled), len(driver.applied)
    decision = engine.step(tokens_batch(8, 20))
    assert decision is not None and decision.new and decision.source.startswith("fitted")
    assert len(driver.profiled) == profiled  # nothing profiled: the plan in place was never taken off,
    assert len(driver.applied) == applied and engine.applied  # and `full` at 20 has its regions: not applied again
    assert _hooks(driver.model) > 0

    def refuse(cost_of, shape):
        raise ValueError(f"no plan at {shape.describe()}")

    engine._shapes.plan_fn = refuse
    with pytest.raises(ValueError, match="no plan at"):
        engine.step(tokens_batch(8, 22))
    assert _hooks(driver.model) == 0 and not engine.applied  # the blocks run as they were
    engine.close()


@pytest.mark.parametrize("metric", ["flops", "ms"])  # (time: as flops; this driver measures no rates)
def test_blocks_are_timed_only_for_the_metric_that_reads_their_times(metric):
    engine, driver = _engine(metric=metric)
    engine.step(tokens_batch(8, 12))
    assert driver.timed_blocks == [metric == "ms"]
    engine.close()


def test_other_blocks_void_what_was_profiled_and_the_same_blocks_keep_it():
    engine, driver = _engine()
    batch = tokens_batch(8, 12)
    engine.step(batch)
    runs = engine.profile_runs
    engine.bind(engine.blocks, engine.block_names)  # the same blocks (a second fit): the profile is kept
    engine.step(batch)
    assert engine.profile_runs == runs and engine.profile is not None
    engine.bind(engine.blocks[:3], engine.block_names[:3])  # other blocks: profiled again
    assert engine.profile is None
    engine.step(batch)
    assert engine.profile_runs == 1 and len(engine.plan.segments) == 3
    engine.close()


def test_another_model_of_the_same_architecture_is_profiled_on_its_own_blocks():
    """A new model whose blocks have the names and parameter shapes of the last one (a new fit of the same
    config) is not the same model: what was profiled is dropped and its own blocks are profiled and planned."""
    engine, driver = _engine()
    batch = tokens_batch(8, 12)
    engine.step(batch)
    other = TinyChain(n_blocks=4, d=16)
    _, names, blocks = resolve_blocks(other, "blocks")
    driver.model = other
    engine.bind(blocks, names, model=other)
    assert engine.profile is None and engine.profile_runs == 0
    engine.step(batch)
    assert engine.profile_runs == 1 and all(a is b for a, b in zip(engine.blocks, blocks))
    assert _hooks(other) > 0 and _hooks(driver.model) == _hooks(other)
    engine.close()
    assert _hooks(other) == 0


def test_a_released_engine_keeps_its_plan_to_read_and_no_blocks():
    engine, driver = _engine()
    engine.step(tokens_batch(8, 12))
    plan, model = engine.plan, driver.model
    engine.release()
    assert engine.blocks == [] and not engine.applied and _hooks(model) == 0
    assert engine.plan is plan and engine.profile is not None and engine.cost is not None
    with pytest.raises(RuntimeError, match=r"none bound yet, or released\): call bind\(blocks, names\) first"):
        engine.step(tokens_batch(8, 12))
    _, names, blocks = resolve_blocks(model, "blocks")
    engine.bind(blocks, names, model=model)  # the same model bound again after a release: planned as the first time
    assert engine.profile is None
    engine.step(tokens_batch(8, 12))
    assert engine.profile_runs == 1 and engine.applied
    engine.close()


def test_a_rank_other_than_zero_plans_nothing_and_applies_rank_zero_s_plan():
    from lightning_ckpt.engine.rank_zero import PlanningOutcome

    reference, _ = _engine(policy="full")
    batch = tokens_batch(8, 12)
    reference.step(batch)
    shared = PlanningOutcome(plan=reference.plan.to_dict())
    reference.close()
    engine, driver = _engine(policy="none", rank=1, shared=shared)  # its own policy would keep everything
    engine.step(batch)
    assert driver.broadcasts == [PlanningOutcome(plan=None)]  # it profiled, planned nothing, took rank 0's
    assert engine.plan.segments == reference.plan.segments and driver.profiled
    engine.close()


def test_rank_zero_s_error_is_raised_on_every_rank():
    from lightning_ckpt import InfeasibleBudgetError
    from lightning_ckpt.engine.rank_zero import PlanningOutcome

    failed = PlanningOutcome.of_error(InfeasibleBudgetError("target_batch_size=8 cannot fit"))
    engine, _ = _engine(rank=1, shared=failed)
    with pytest.raises(InfeasibleBudgetError, match="target_batch_size=8 cannot fit"):
        engine.step(tokens_batch(8, 12))
    engine, _ = _engine(budget=1)  # rank 0 itself
    with pytest.raises(InfeasibleBudgetError, match=r"the training batch of shape \(batch 8, .*not even batch size 1 fits"):
        engine.step(tokens_batch(8, 12))


def test_a_plan_made_elsewhere_on_the_blocks_is_refused():
    engine, driver = _engine()
    outside = apply_segments(engine.blocks, [(0, 1)])
    with pytest.raises(ValueError, match=r"cannot profile the blocks: 2 block\(s\) already run under an applied plan"):
        engine.step(tokens_batch(8, 12))
    outside.remove()
    engine.step(tokens_batch(8, 12))
    assert engine.applied
    engine.close()


def test_the_model_s_own_checkpointing_kept_in_charge_applies_nothing(monkeypatch):
    """With keep_hf_checkpointing and a model whose own checkpointing is on, plans are made, not applied."""
    from lightning_ckpt.engine.model_prep import Prepared

    engine, driver = _engine()
    kept = Prepared(hf_checkpointing="every layer", hf_checkpointing_kept=True)
    monkeypatch.setattr("lightning_ckpt.engine.checkpoint_engine.prepare_model", lambda model, **kw: kept)
    engine.bind(engine.blocks, engine.block_names, model=driver.model)
    assert engine.step(tokens_batch(8, 12)) is not None and engine.plan.segments
    assert not driver.applied and not engine.applied and engine.step(tokens_batch(8, 12)) is None
    engine.close()


def test_what_the_model_can_only_report_is_said_once(monkeypatch):
    """The hazards `prepare_model` reads off the model (LayerDrop, output_* flags) reach the front end
    as warnings, each once however often the blocks are bound again (a second fit)."""
    from lightning_ckpt.engine.model_prep import Prepared

    engine, driver = _engine()
    hazards = ("layerdrop=0.1 in the HF config of Stack at 'decoder': LayerDrop skips layers", "output_attentions=True")
    monkeypatch.setattr(
        "lightning_ckpt.engine.checkpoint_engine.prepare_model", lambda model, **kw: Prepared(hazards=hazards)
    )
    engine.bind(engine.blocks, engine.block_names, model=driver.model)
    engine.bind(engine.blocks, engine.block_names, model=driver.model)
    assert [m for m in driver.messages if "layerdrop" in m or "output_attentions" in m] == [
        f"lightning-ckpt: {h}." for h in hazards
    ]
    engine.close()


def test_engine_needs_blocks_first():
    engine = CheckpointEngine(EngineSettings(10**9), Driver(TinyChain()))
    with pytest.raises(RuntimeError, match=r"call bind\(blocks, names\) first"):
        engine.step(tokens_batch(8, 12))
