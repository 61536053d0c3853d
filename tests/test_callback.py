"""The Lightning callback end to end on CPU: plan, apply, batch size, state, errors."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from lit_models import LitChain, TokenData, make_trainer

from lightning_ckpt import (
    ActivationCheckpointing,
    InfeasibleBudgetError,
    apply_segments,
)

BUDGET = 10 * 2**20


def _fit(callbacks, seed=0, max_steps=3, data=None, model=None):
    pl.seed_everything(seed, verbose=False)
    model = model or LitChain()
    data = data or TokenData(batch_size=8)
    trainer = make_trainer(callbacks, max_steps=max_steps)
    trainer.fit(model, datamodule=data)
    return model, data, trainer


def _peak_between_full_and_none(cb_policy="optimal"):
    """A budget that forces some but not all checkpointing, from a first planning run."""
    probe = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="none", verbose=False)
    _fit([probe], max_steps=1)
    from lightning_ckpt.planning.policies import make_plan

    none = make_plan(probe.cost, "none").predicted_peak_bytes
    full = make_plan(probe.cost, "full").predicted_peak_bytes
    return probe, (none + full) // 2


def test_callback_same_losses_as_plan_applied_by_hand():
    _, budget = _peak_between_full_and_none()
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget=budget, policy="optimal", verbose=False)
    model, _, _ = _fit([cb])
    plan = cb.plan
    assert plan is not None and plan.fits and 0 < len(plan.checkpointed) < 6
    assert plan.predicted_peak_bytes <= budget

    pl.seed_everything(0, verbose=False)
    manual = LitChain()
    apply_segments(list(manual.net.blocks), plan.segments, inner_segments=plan.inner_segments)
    make_trainer(max_steps=3).fit(manual, datamodule=TokenData(batch_size=8))
    assert len(model.losses) == len(manual.losses) == 3
    for a, b in zip(model.losses, manual.losses):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("policy", "every_k"), [("none", None), ("full", None), ("every_k", 2), ("sqrt", None), ("greedy", None), ("optimal", None)]
)
def test_every_policy_bit_identical_to_no_checkpointing(policy, every_k, budget_midpoint):
    """Every policy: losses and all gradients after 3 optimizer steps (fp32, dropout on) equal
    those of the run without the callback, bit for bit."""
    budget = budget_midpoint if policy in ("greedy", "optimal") else "1GiB"
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget=budget, policy=policy, every_k=every_k, verbose=False)
    model, _, _ = _fit([cb])
    reference, _, _ = _fit([])
    if policy != "none":
        assert cb.plan.checkpointed, policy
    assert len(model.losses) == 3
    for a, b in zip(model.losses, reference.losses):
        assert torch.equal(a, b)
    assert model.last_grads.keys() == reference.last_grads.keys() and len(model.last_grads) > 10
    for name, g in reference.last_grads.items():
        assert torch.equal(model.last_grads[name], g), name


def test_op_level_plan_bit_identical_to_no_checkpointing(budget_midpoint):
    """granularity='op': some blocks keep op outputs (dropout masks, matmuls); losses and all
    gradients after 3 steps (fp32, dropout on) equal those without the callback, bit for bit."""
    # in `flops` keeping costs no dispatch overhead, so this tiny model's blocks do keep calls
    cb = ActivationCheckpointing(
        target_batch_size=8, memory_budget=budget_midpoint, granularity="op", cost_metric="flops", verbose=False
    )
    model, _, _ = _fit([cb])
    reference, _, _ = _fit([])
    assert cb.plan.keeps and cb.plan.granularity == "op" and cb.plan.fits
    assert "selective" in str(cb.plan)
    for a, b in zip(model.losses, reference.losses):
        assert torch.equal(a, b)
    for name, g in reference.last_grads.items():
        assert torch.equal(model.last_grads[name], g), name


def test_resume_at_another_granularity_plans_again(tmp_path, budget_midpoint):
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget=budget_midpoint, verbose=False, report=False)
    t = make_trainer([cb], max_steps=1)
    t.fit(LitChain(), datamodule=TokenData(batch_size=8))
    t.save_checkpoint(tmp_path / "block.ckpt")
    ckpt = torch.load(tmp_path / "block.ckpt", weights_only=False)
    state = next(v for k, v in ckpt["callbacks"].items() if "ActivationCheckpointing" in k)
    strict = ActivationCheckpointing(
        target_batch_size=8, memory_budget=budget_midpoint, granularity="op", verbose=False, report=False,
        strict_resume=True,
    )
    strict.load_state_dict(state)
    with pytest.raises(ValueError, match=r"granularity 'block', granularity is 'op'"):
        _fit([strict], max_steps=1)


@pytest.fixture(scope="module")
def budget_midpoint():
    return _peak_between_full_and_none()[1]


def test_callback_sets_loader_batch_size_and_exposes_plan():
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="full", blocks="net.blocks", verbose=False)
    model, data, _ = _fit([cb], data=TokenData(batch_size=4))
    assert data.batch_size == 8
    plan = cb.plan
    assert plan.checkpointed == tuple(range(6))
    assert plan.segments == tuple((i, i) for i in range(6))
    assert isinstance(plan.predicted_peak_bytes, int) and plan.recompute_flops > 0
    assert "checkpoint" in str(plan) and plan.to_dict()["policy"] == "full"
    # hooks are gone after fit: the model is plain again
    assert all(len(b._forward_pre_hooks) == 0 for b in model.net.blocks)


def test_state_dict_keys_unchanged_and_checkpoint_loads_into_plain_model(tmp_path):
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="full", verbose=False)
    pl.seed_everything(0, verbose=False)
    model = LitChain()
    plain_keys = list(LitChain().state_dict().keys())
    trainer = make_trainer([cb], max_steps=2)
    seen = {}

    class Peek(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen["keys"] = list(pl_module.state_dict().keys())
            trainer.save_checkpoint(tmp_path / "mid.ckpt")

    trainer.callbacks.append(Peek())
    trainer.fit(model, datamodule=TokenData(batch_size=8))
    assert seen["keys"] == plain_keys
    ckpt = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    plain = LitChain()
    plain.load_state_dict(ckpt["state_dict"])  # strict
    assert torch.equal(plain.net.head.weight, model.net.head.weight)
    assert any("ActivationCheckpointing" in k for k in ckpt["callbacks"])


def test_infeasible_target_names_largest_batch():
    probe, _ = _peak_between_full_and_none()
    from lightning_ckpt.profiling.memory.static_memory import StaticMemory

    static = StaticMemory(
        param_bytes=probe.cost.static_bytes, buffer_bytes=0, grad_bytes=0, optimizer_state_bytes=0,
        optimizer_transient_bytes=probe.cost.optimizer_transient_bytes,
    )
    from lightning_ckpt.planning.policies import make_plan

    full_8 = make_plan(probe.cost, "full").predicted_peak_bytes
    budget = full_8 - 1  # batch 8 cannot fit even fully checkpointed
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget=budget, verbose=False)
    with pytest.raises(InfeasibleBudgetError, match=r"target_batch_size=8 .* the largest batch that fits with policy='optimal' is (\d+)") as info:
        _fit([cb])
    import re

    largest = int(re.search(r"is (\d+)", str(info.value)).group(1))
    assert 1 <= largest < 8
    from lightning_ckpt.engine.target_plan import cost_at

    assert make_plan(cost_at(cb.profile, largest, static), "optimal", budget).fits
    with pytest.raises(InfeasibleBudgetError):
        make_plan(cost_at(cb.profile, largest + 1, static), "optimal", budget)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_batch_size": 0}, r"target_batch_size=0 must be a positive integer"),
        ({"target_batch_size": -4}, r"target_batch_size=-4 must be a positive integer"),
        ({"target_batch_size": "8"}, r"target_batch_size='8' must be a positive integer"),
        ({"target_batch_size": 8, "memory_budget": 0}, r"memory_budget=0 must be a positive number of bytes"),
        ({"target_batch_size": 8, "memory_budget": -5}, r"memory_budget=-5 must be a positive"),
        ({"target_batch_size": 8, "memory_budget": "lots"}, r"memory_budget='lots' is not a size"),
        ({"target_batch_size": 8, "memory_budget": "6 gigs"}, r"memory_budget='6 gigs' is not a size .* GiB"),
        ({"target_batch_size": 8, "memory_budget": "1GiB", "policy": "fast"}, r"policy='fast' is not a known policy"),
        ({"target_batch_size": 8, "memory_budget": "1GiB", "every_k": 2}, r"every_k=2 only applies to policy='every_k'"),
        ({"target_batch_size": 8, "memory_budget": "1GiB", "blocks": ""}, r"blocks='' must be a dotted path"),
        ({"target_batch_size": 8, "memory_budget": "1GiB", "probe_batch_sizes": (2, 2)}, r"two different positive integers"),
        ({"target_batch_size": 8, "memory_budget": "1GiB", "probe_batch_sizes": (0, 2)}, r"probe_batch_sizes=0 must be a positive"),
        ({"target_batch_size": "maximum"}, r"target_batch_size='maximum' must be a positive integer; .* or 'max'"),
        ({"target_batch_size": "max", "batch_multiple": 0}, r"batch_multiple=0 must be a positive integer"),
        ({"target_batch_size": 8, "batch_multiple": 8}, r"batch_multiple=8 only applies to target_batch_size='max'"),
        ({"target_batch_size": 8, "cost_metric": "joules"}, r"cost_metric='joules' is not known; choose 'flops' .*'ms' .*or 'time'"),
        ({"target_batch_size": 8, "check_batch_size": 0}, r"check_batch_size=0 must be a positive integer"),
        ({"target_batch_size": 8, "granularity": "layer"}, r"granularity='layer' is not known; choose 'block' .* or 'op'"),
        ({"target_batch_size": 8, "policy": "full", "granularity": "op"}, r"granularity='op' is planned by policy='optimal' only"),
        ({"target_batch_size": 8, "policy": "every_k", "every_k": 0}, r"every_k=0 must be a positive integer"),
        ({"target_batch_size": 8, "memory_budget": True}, r"memory_budget=True is a bool"),
        ({"target_batch_size": 8, "memory_budget": [1]}, r"memory_budget=\[1\] has type list"),
    ],
)
def test_bad_arguments(kwargs, match):
    """The table above: each bad argument and the error it must get."""
    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(**kwargs)


def test_unknown_blocks_path_lists_candidates():
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", blocks="encoder.layers", verbose=False)
    with pytest.raises(ValueError, match=r"blocks='encoder.layers' is not a submodule .* 'net.blocks' \(6 blocks\)"):
        _fit([cb])


def test_network_built_in_configure_model():
    """Blocks are found after `configure_model`, where Lightning has the network built: the plan is the
    one of the same network built in `__init__`, with the same losses; a wrong path still names what exists."""
    from lit_models import LitLazyChain

    _, budget = _peak_between_full_and_none()
    planned = {}
    for cls in (LitChain, LitLazyChain):
        cb = ActivationCheckpointing(target_batch_size=8, memory_budget=budget, blocks="net.blocks", verbose=False,
                                     report=False, cost_metric="flops")
        model, _, _ = _fit([cb], model=cls())
        planned[cls.__name__] = (cb.plan.segments, cb.block_names)
    assert planned["LitLazyChain"] == planned["LitChain"]
    assert planned["LitChain"][0] and planned["LitChain"][1][0] == "net.blocks.0"
    plain, _, _ = _fit([], model=LitLazyChain())  # seeded as above before `configure_model` builds the net
    assert [float(x) for x in model.losses] == [float(x) for x in plain.losses]

    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", blocks="model.layers", verbose=False)
    with pytest.raises(ValueError, match=r"blocks='model.layers' is not a submodule .* 'net.blocks' \(6 blocks\)"):
        _fit([cb], model=LitLazyChain())


def test_model_without_repeated_blocks():
    class Flat(LitChain):
        def __init__(self):
            super().__init__()
            self.net.blocks = torch.nn.ModuleList()  # the forward runs no block

    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", verbose=False)
    with pytest.raises(ValueError, match=r"has no nn.ModuleList .* no chain to find\. Pass blocks=\[\.\.\.\]"):
        _fit([cb], model=Flat())


def test_cpu_without_budget():
    cb = ActivationCheckpointing(target_batch_size=8, verbose=False)
    with pytest.raises(ValueError, match=r"memory_budget was not given and the training device is 'cpu'"):
        _fit([cb])


def test_profiling_leaves_metrics_logging_and_rng_untouched():
    """Losses with the callback (policy none) equal losses without any callback."""
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="none", verbose=False)
    with_cb, _, _ = _fit([cb])
    without, _, _ = _fit([])
    assert all(torch.equal(a, b) for a, b in zip(with_cb.losses, without.losses))
    assert len(with_cb.losses) == 3  # profiling steps are not counted as training steps


# ----------------------------------------------------------------------------- resume, max, report


def test_resume_reuses_plan_without_profiling_and_matches_uninterrupted(tmp_path, budget_midpoint):
    """Step k=2 is checkpointed during a 4-step run; resuming from it repeats steps 3-4 exactly.

    2 batches per epoch, so k falls on an epoch boundary: Lightning restarts a plain
    DataLoader from its first batch when resuming mid-epoch, checkpointing or not."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def cb():
        return ActivationCheckpointing(target_batch_size=8, memory_budget=budget_midpoint, verbose=False, report=False)

    pl.seed_everything(0, verbose=False)
    whole_cb = cb()
    whole = LitChain(p=0.0, lr=1e-3)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer([whole_cb, saver], max_steps=4, enable_checkpointing=True).fit(whole, datamodule=TokenData(8, n=16))
    assert whole_cb.plan.checkpointed and whole_cb.profiled_steps == 1

    resumed_cb = cb()
    resumed = LitChain(p=0.0, lr=1e-3)
    make_trainer([resumed_cb], max_steps=4).fit(resumed, datamodule=TokenData(8, n=16), ckpt_path=tmp_path / "step=2.ckpt")
    assert resumed_cb.profiled_steps == 0
    assert resumed_cb.plan == whole_cb.plan  # the very same plan, measured timings included
    assert len(resumed.losses) == 2
    for a, b in zip(resumed.losses, whole.losses[2:]):
        assert torch.equal(a, b)


def test_resume_with_changed_model_replans_or_raises(tmp_path):
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="full", verbose=False, report=False)
    t = make_trainer([cb], max_steps=1)
    t.fit(LitChain(n_blocks=6), datamodule=TokenData(batch_size=8))
    t.save_checkpoint(tmp_path / "six.ckpt")
    ckpt = torch.load(tmp_path / "six.ckpt", weights_only=False)
    state = next(v for k, v in ckpt["callbacks"].items() if "ActivationCheckpointing" in k)

    again = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="full", verbose=False, report=False)
    again.load_state_dict(state)
    _fit([again], model=LitChain(n_blocks=5), max_steps=1)
    assert again.profiled_steps == 1 and again.plan.n_blocks == 5

    strict = ActivationCheckpointing(
        target_batch_size=8, memory_budget="1GiB", policy="full", verbose=False, report=False, strict_resume=True
    )
    strict.load_state_dict(state)
    with pytest.raises(ValueError, match=r"does not match this run: the blocks changed .* strict_resume=True"):
        _fit([strict], model=LitChain(n_blocks=5), max_steps=1)


def test_time_metric_plans_and_explains_itself(budget_midpoint):
    cb = ActivationCheckpointing(
        target_batch_size=8, memory_budget=budget_midpoint, cost_metric="time", verbose=False, report=False
    )
    _fit([cb], max_steps=1)
    plan = cb.plan
    assert plan.fits and plan.checkpointed and plan.cost_metric == "time"
    assert plan.recompute_est_ms > 0 and plan.rates == cb.cost.meta["rates"]
    assert "cost_metric=time" in str(plan) and "estimated recompute" in str(plan)


def test_max_batch_size_from_the_model(budget_midpoint):
    cb = ActivationCheckpointing(
        target_batch_size="max", memory_budget=budget_midpoint, batch_multiple=4, verbose=False, report=False
    )
    data = TokenData(batch_size=4, n=256)
    _fit([cb], data=data, max_steps=1)
    best = cb.batch_size
    assert best % 4 == 0 and best >= 8 and data.batch_size == best
    assert cb.plan.fits and cb.plan.batch_size == best
    from lightning_ckpt.engine.target_plan import cost_at
    from lightning_ckpt.planning.capacity import plan_if_fits

    assert plan_if_fits(cost_at(cb.profile, best + 4, cb.engine._static), cb._budget_bytes) is None
    with pytest.raises(ValueError, match="batch_multiple=4 only applies to target_batch_size='max'"):
        ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", batch_multiple=4)


def test_report_and_measured_peak_written(tmp_path, budget_midpoint):
    from lightning.pytorch.loggers import CSVLogger

    cb = ActivationCheckpointing(target_batch_size=8, memory_budget=budget_midpoint, verbose=False, measure_peak=True)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[cb], logger=CSVLogger(tmp_path), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(LitChain(), datamodule=TokenData(batch_size=8))
    names = {p.name for p in cb.report_paths}
    assert names == {"lightning_ckpt_plan.json", "lightning_ckpt_tradeoff.png"}
    assert all(p.exists() and p.stat().st_size > 1000 for p in cb.report_paths)
    assert cb.measured_peak_bytes is not None
    assert abs(cb.measured_peak_bytes - cb.plan.predicted_peak_bytes) / cb.measured_peak_bytes < 0.10
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    for key in ("ckpt/predicted_peak_bytes", "ckpt/recompute_share", "ckpt/measured_peak_bytes"):
        assert key in metrics


def test_memory_the_model_does_not_see_is_caught_and_its_shape_planned_again_with_it_in_reserve(budget_midpoint):
    """From step 1 on, the step keeps a tensor alive across steps that no profile saw. The first steady step,
    measured by default, is over the budget: one loud warning with both numbers, and the shape is planned again
    at once with the excess over the prediction held in reserve; by the tests' own tracker that step was over
    and every step after it is within the budget."""
    import warnings

    from hf_models import StepPeaks

    from lightning_ckpt.planning.policies import make_plan

    class KeepsATensor(LitChain):
        def training_step(self, batch, batch_idx):
            if batch_idx >= 1:  # after the shape was profiled and planned: nothing of it is in the memory model
                if not hasattr(self, "kept_bytes"):  # over the budget by half the room the plan has above `full`
                    predicted, full = cb.plan.predicted_peak_bytes, make_plan(cb.cost, "full").predicted_peak_bytes
                    self.kept_bytes = budget_midpoint - predicted + (predicted - full) // 2
                self.kept = torch.zeros(self.kept_bytes // 4)  # the last step's is freed when this one is made
            return super().training_step(batch, batch_idx)

    cb = ActivationCheckpointing(target_batch_size=8, memory_budget=budget_midpoint, verbose=False, report=False)
    peaks = StepPeaks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit([cb, peaks], max_steps=4, model=(model := KeepsATensor()))
    over = [str(w.message) for w in caught if "OVER THE MEMORY BUDGET" in str(w.message)]
    assert len(over) == 1, over
    size = r"[\d.]+ [KM]iB"
    assert re.search(rf"at shape \(batch 8, .*\): the step measured {size} \(tracked tensors\), {size} over the memory_budget "
                     rf"of {size}; the plan predicted {size}, so {size} of the step is memory the memory model does not see "
                     rf".* Re-planned that shape with {size} held in reserve", over[0]), over[0]
    reserve = cb.engine.reserves.held(cb.engine.shape)
    assert model.kept_bytes <= reserve <= model.kept_bytes + 16 * 1024  # the kept tensor, as measured
    assert cb.plan.predicted_peak_bytes + reserve <= budget_midpoint
    assert peaks.peaks[1] > budget_midpoint and max(peaks.peaks[2:]) <= budget_midpoint, (peaks.peaks, budget_midpoint)
    assert list(cb.measured_peaks.values()) == [peaks.peaks[2]]  # measured again under the new plan, within


def test_noop_with_info_line_when_nothing_needs_checkpointing(caplog):
    import logging

    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", report=False)
    with caplog.at_level(logging.INFO):
        _fit([cb], max_steps=1)
    assert cb.plan.segments == ()
    assert "nothing to checkpoint" in caplog.text and "Training runs unchanged" in caplog.text


# ----------------------------------------------------------------------------- probes, measuring, hooks


@pytest.mark.parametrize(
    ("batch_size", "probes", "match"),
    [
        (4, (8, 16), (r"probe_batch_sizes=\(8, 16\) but the first training batch has 4 samples; the probes are "
                      r"slices of that batch\. Set probe_batch_sizes to two sizes <= 4, e\.g\. \(1, 2\)\.")),
        (4, (2, 5), r"probe_batch_sizes=\(2, 5\) but the first training batch has 4 samples"),
    ],
)
def test_probes_larger_than_the_first_batch_raise(batch_size, probes, match):
    """Probe sizes are never clamped: a probe the first batch cannot give is an error that says what to set."""
    cb = ActivationCheckpointing(
        target_batch_size=batch_size, memory_budget="1GiB", probe_batch_sizes=probes, verbose=False, report=False
    )
    with pytest.raises(ValueError, match=match):
        _fit([cb], data=TokenData(batch_size=batch_size), max_steps=1)
    assert cb.profile is None and cb.plan is None


def test_check_batch_size_larger_than_the_batch_is_skipped_with_one_info_line(caplog):
    import logging

    cb = ActivationCheckpointing(target_batch_size=2, memory_budget="1GiB", check_batch_size=4, verbose=False, report=False)
    with caplog.at_level(logging.INFO):
        _fit([cb], data=TokenData(batch_size=2), max_steps=2)
    assert cb.profile.check is None and cb.plan is not None
    assert caplog.text.count("check_batch_size=4 is larger than the first training batch (2 samples)") == 1


def _dispatch_modes() -> list[str]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [type(m).__name__ for m in _get_current_dispatch_mode_stack()]


def test_cpu_peak_tracker_spans_exactly_the_first_steady_step():
    """The tracker is on only from the start to the end of step 1 (step 0 has no optimizer state yet)."""
    seen = []

    class Modes(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((batch_idx, "start", _dispatch_modes()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((batch_idx, "end", _dispatch_modes()))

    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", measure_peak=True, verbose=False, report=False)
    _fit([cb, Modes()], max_steps=3)
    tracked = [(i, when) for i, when, modes in seen if "StepBytesTracker" in modes]
    assert tracked == [(1, "start")]
    assert cb.measured_peak_bytes is not None and cb.measured_peak_bytes > 0
    assert _dispatch_modes() == []


def test_failure_in_the_measured_step_leaves_no_tracker_and_no_hooks():
    """Lightning skips `teardown` when fit raises: the callback still closes the tracker and removes its hooks."""

    class FailsAtStep1(LitChain):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 1:
                raise RuntimeError("stop at step 1")
            return super().training_step(batch, batch_idx)

    cb = ActivationCheckpointing(
        target_batch_size=8, memory_budget="1GiB", policy="full", measure_peak=True, verbose=False, report=False
    )
    model = FailsAtStep1()
    with pytest.raises(RuntimeError, match="stop at step 1"):
        _fit([cb], model=model)
    assert _dispatch_modes() == []
    assert cb.measured_peak_bytes is None
    assert all(len(b._forward_pre_hooks) == 0 for b in model.net.blocks)


def test_hooks_are_marked_override_and_fit_adds_no_attributes():
    """Each Lightning hook the callback defines carries `@override`; every attribute exists after `__init__`."""
    from lightning.pytorch.callbacks import Callback

    hooks = [name for name in vars(ActivationCheckpointing) if name in vars(Callback) and not name.startswith("__")]
    assert {"setup", "on_fit_start", "on_train_batch_start", "on_train_batch_end", "teardown"} <= set(hooks)
    for name in hooks:
        assert getattr(getattr(ActivationCheckpointing, name), "__override__", False), name
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", measure_peak=True, verbose=False)
    before = set(vars(cb))
    _fit([cb], max_steps=2)
    attached_by_lightning = {"log", "log_dict"}  # the module's logging methods, put on every callback by the Trainer
    assert set(vars(cb)) - attached_by_lightning == before


# ----------------------------------------------------------------------------- multi-level plans

LONG_SEQ = 64  # boundaries of 64 tokens: each block saves 11x its input, far above the gradients


@pytest.fixture(scope="module")
def under_full_peak():
    """One byte under `full`'s predicted peak at batch 8 with sequences of `LONG_SEQ` tokens: no
    single-level plan fits there, a plan that rebuilds segments inside a segment's recompute does."""
    from lightning_ckpt.planning.policies import make_plan

    probe = ActivationCheckpointing(target_batch_size=8, memory_budget="1GiB", policy="none", verbose=False, report=False)
    _fit([probe], max_steps=1, data=TokenData(batch_size=8, seq=LONG_SEQ))
    return make_plan(probe.cost, "full").predicted_peak_bytes - 1


def test_nested_plan_fits_under_full_peak_and_trains_bit_identically(under_full_peak):
    """max_levels=2 (the default): the plan has inner segments, fits, and 3 steps (fp32, dropout on)
    give the losses and gradients of the run without the callback, bit for bit."""
    cb = ActivationCheckpointing(target_batch_size=8, memory_budget=under_full_peak, verbose=False, report=False)
    model, _, _ = _fit([cb], data=TokenData(batch_size=8, seq=LONG_SEQ))
    reference, _, _ = _fit([], data=TokenData(batch_size=8, seq=LONG_SEQ))
    plan = cb.plan
    assert plan.inner_segments and plan.fits and plan.predicted_peak_bytes <= under_full_peak
    assert max(r.level for r in plan.rows) == 2 and "nested L2" in str(plan)
    assert len(model.losses) == 3
    for a, b in zip(model.losses, reference.losses):
        assert torch.equal(a, b)
    assert model.last_grads.keys() == reference.last_grads.keys() and len(model.last_grads) > 10
    for name, g in reference.last_grads.items():
        assert torch.equal(model.last_grads[name], g), name


def test_single_level_under_full_peak_is_infeasible(under_full_peak):
    """max_levels=1 at the budget the nested plan fits: the target cannot fit, and the error says
    that max_levels=1 is why (raising it is the way out) and names the largest batch that fits."""
    cb = ActivationCheckpointing(
        target_batch_size=8, memory_budget=under_full_peak, max_levels=1, verbose=False, report=False
    )
    match = r"target_batch_size=8 with policy='optimal'.*max_levels=1.* the largest batch that fits with policy='optimal' is (\d+)"
    with pytest.raises(InfeasibleBudgetError, match=match) as info:
        _fit([cb], data=TokenData(batch_size=8, seq=LONG_SEQ), max_steps=1)
    assert cb.plan is None
    import re

    assert 1 <= int(re.search(r"policy='optimal' is (\d+)", str(info.value)).group(1)) < 8
