"""`auto_checkpoint` in a plain PyTorch loop: the callback's plan, losses bit-identical, every step
within the budget, every shape planned, and each misuse refused with what to do."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from models import TinyChain, tokens_batch

from lightning_ckpt import auto_checkpoint, make_plan, measure_step_peak
from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.engine.target_plan import cost_at
from lightning_ckpt.profiling.structure.blocks import resolve_blocks
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.profiling.memory.static_memory import static_memory

N_BLOCKS, D, BATCH = 6, 32, 8


def _model() -> TinyChain:
    torch.manual_seed(0)
    return TinyChain(n_blocks=N_BLOCKS, d=D, p=0.1)


def _batches(n: int = 4, seq: int = 16, lengths=None):
    lengths = lengths or [seq] * n
    out = []
    for i, s in enumerate(lengths):
        out.append(tokens_batch(BATCH, s, seed=i))
    return out


def _loss(model):
    return lambda b: F.cross_entropy(model(b[0]), b[1])


def _budget(model, batch) -> int:
    """Half way between the `full` and `none` peaks of the step at `batch`."""
    _, _, blocks = resolve_blocks(model, "blocks")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    profile = profile_model(model, blocks, _loss(model), batch, timing=False)
    cost = cost_at(profile, batch[0].shape[0], static_memory(model, [opt]))
    lo, hi = (make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
    return (lo + hi) // 2


def _train(model, batches, handle=None, lr=0.05):
    """The loop as a user writes it; -> (losses, measured peak of every step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, peaks = [], []  # dropout draws from where the model's init left the RNG: profiling must not move it
    for batch in batches:
        if handle is not None:
            handle.step(batch)
        peaks.append(measure_step_peak(model, _loss(model), batch, opt))
    for batch in batches:  # and the same steps once more, as losses
        if handle is not None:
            handle.step(batch)
        loss = _loss(model)(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, peaks


def _hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_plain_loop_is_bit_identical_within_the_budget_and_leaves_no_hook():
    batches = _batches()
    budget = _budget(_model(), batches[0])
    plain = _model()
    ref_losses, ref_peaks = _train(plain, batches)
    checkpointed = _model()
    opt = torch.optim.AdamW(checkpointed.parameters(), lr=0.05)
    handle = auto_checkpoint(  # rates measured too (they draw random numbers): the RNG must come back as it was
        checkpointed, budget, example_batch=batches[0], step_fn=_loss(checkpointed), optimizer=opt,
        blocks="blocks", cost_metric="time", verbose=False,
    )
    assert handle.plan.segments and handle.plan.fits and handle.batch_size == BATCH
    losses, peaks = _train(checkpointed, batches, handle)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), checkpointed.parameters()))
    assert max(peaks) <= budget < max(ref_peaks)
    assert abs(peaks[-1] - handle.plan.predicted_peak_bytes) <= 0.03 * peaks[-1]
    handle.remove()
    assert _hooks(checkpointed) == 0
    assert _hooks(checkpointed) == _hooks(plain)


def test_the_plan_is_the_callbacks():
    """The same model, batch, optimizer and budget, and a loop whose last gradients are alive at the forward
    as Lightning's are (it zeroes them after the forward): the callback and auto_checkpoint plan alike."""
    from lit_models import LitChain, make_trainer

    from lightning_ckpt import ActivationCheckpointing

    lit = LitChain(n_blocks=N_BLOCKS, d=32, p=0.1)
    batch = _batches(1)[0]
    budget = _budget(copy.deepcopy(lit.net), batch)
    cb = ActivationCheckpointing(
        target_batch_size=BATCH, memory_budget=budget, blocks="net.blocks", cost_metric="flops", verbose=False,
        report=False,
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*batch), batch_size=BATCH)
    make_trainer([cb], max_steps=1).fit(copy.deepcopy(lit), train_dataloaders=loader)
    opt = torch.optim.AdamW(lit.parameters(), lr=0.05)
    lit.training_step(batch, 0).backward()  # last step's gradients, alive at the next forward
    with auto_checkpoint(
        lit, budget, example_batch=batch, step_fn=lambda b: lit.training_step(b, 0), optimizer=opt,
        blocks="net.blocks", cost_metric="flops", verbose=False,
    ) as handle:
        assert handle.plan.segments == cb.plan.segments
        assert handle.plan.predicted_peak_bytes == cb.plan.predicted_peak_bytes
        assert handle.block_names == cb.block_names
    assert _hooks(lit) == 0


def test_variable_lengths_are_planned_each_within_the_budget():
    lengths = [16, 24, 12, 32, 24]
    batches = _batches(lengths=lengths)
    model = _model()
    budget = _budget(_model(), batches[3])  # half way at the longest: the shorter ones fit with less
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _loss(model)(batches[0]).backward()  # gradients alive at each forward from the first (`measure_step_peak`'s order)
    handle = auto_checkpoint(
        model, budget, example_batch=batches[0], step_fn=_loss(model), optimizer=opt, blocks="blocks",
        cost_metric="flops", verbose=False,
    )
    peaks = []
    for batch in batches:
        handle.step(batch)
        peaks.append(measure_step_peak(model, _loss(model), batch, opt))
        assert handle.plan.fits
    assert len(handle.plans) == len(set(lengths))
    assert max(peaks) <= budget
    handle.remove()


def test_target_batch_size_other_than_the_example_and_max():
    model, batch = _model(), _batches(1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    budget = _budget(_model(), batch)
    with auto_checkpoint(model, budget, example_batch=batch, step_fn=_loss(model), optimizer=opt, blocks="blocks",
                         target_batch_size="max", cost_metric="flops", verbose=False) as best:
        largest = best.batch_size
        assert largest > BATCH and best.plan.fits
    with auto_checkpoint(model, budget, example_batch=batch, step_fn=_loss(model), optimizer=opt, blocks="blocks",
                         target_batch_size=largest, cost_metric="flops", verbose=False) as fixed:
        assert fixed.batch_size == largest and fixed.plan.segments == best.plan.segments
        x = torch.cat([batch[0]] * (largest // BATCH + 1))[:largest]
        big = (x, (x[:, 0] % 3).long())
        fixed.step(big)  # the planned shape: nothing to do
        assert measure_step_peak(model, _loss(model), big, opt) <= budget


def test_a_larger_batch_without_step_is_refused_before_its_forward():
    model, batch = _model(), _batches(1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    with auto_checkpoint(model, 10**9, example_batch=batch, step_fn=_loss(model), optimizer=opt, blocks="blocks",
                         cost_metric="flops", verbose=False):
        _loss(model)(batch).backward()  # the planned shape
        _loss(model)((batch[0][:4], batch[1][:4])).backward()  # smaller: fits what was planned
        longer = _batches(1, seq=40)[0]
        with pytest.raises(RuntimeError, match=r"larger than the planned steps.*Call handle\.step\(batch\)"):
            _loss(model)(longer)
        with torch.no_grad():
            model(longer[0])  # evaluation holds no activations for backward: not checked


def test_applying_twice_is_refused():
    model, batch = _model(), _batches(1)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    kw = dict(example_batch=batch, step_fn=_loss(model), optimizer=opt, blocks="blocks", policy="full", verbose=False)
    with auto_checkpoint(model, 10**9, **kw):
        with pytest.raises(ValueError, match=r"cannot profile the blocks: 6 block\(s\) already run under an applied plan"):
            auto_checkpoint(model, 10**9, **kw)
        _, _, blocks = resolve_blocks(model, "blocks")
        with pytest.raises(ValueError, match=r"cannot apply a plan: .* already run under an applied plan .*remove"):
            apply_segments(blocks, [(0, 1)])
    applied = apply_segments(resolve_blocks(model, "blocks")[2], [(0, 5)])  # removed: applies again
    applied.remove()
    assert _hooks(model) == 0


def test_profiling_under_an_applied_plan_is_refused():
    model, batch = _model(), _batches(1)[0]
    _, names, blocks = resolve_blocks(model, "blocks")
    applied = apply_segments(blocks, [(0, 2)])
    with pytest.raises(ValueError, match=r"cannot profile the blocks.*already run under an applied plan"):
        profile_model(model, blocks, _loss(model), batch, names=names, timing=False)
    applied.remove()


def test_bad_input_is_refused_with_what_to_do():
    model, batch = _model(), _batches(1)[0]
    kw = dict(example_batch=batch, step_fn=_loss(model), verbose=False)
    with pytest.raises(ValueError, match=r"no nn.ModuleList .* no chain to find\. Pass blocks="):
        auto_checkpoint(torch.nn.Linear(3, 3), 10**9, example_batch=torch.zeros(4, 3), step_fn=lambda b: b.sum())
    with pytest.raises(ValueError, match=r"memory_budget was not given and the training device is 'cpu'"):
        auto_checkpoint(model, None, **kw)
    with pytest.raises(TypeError, match=r"step_fn=.* is not callable"):
        auto_checkpoint(model, 10**9, example_batch=batch, step_fn=None)
    with pytest.raises(ValueError, match=r"policy='fastest' is not a known policy"):
        auto_checkpoint(model, 10**9, policy="fastest", **kw)

    class Lion(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-3})

    with pytest.raises(ValueError, match=r"optimizer=Lion has no state yet .* Pass optimizer_state_bytes="):
        auto_checkpoint(model, 10**9, optimizer=Lion(model.parameters()), **kw)
    with auto_checkpoint(model, 10**9, optimizer=Lion(model.parameters()), optimizer_state_bytes=1000, **kw) as h:
        assert h.plan.fits
    with pytest.raises(ValueError, match=r"got a compiled model .* Call auto_checkpoint on the uncompiled model"):
        auto_checkpoint(torch.compile(model), 10**9, **kw)
    with pytest.raises(ValueError, match=r"probe_batch_sizes=\(8, 16\) but the batch has 8 samples"):
        auto_checkpoint(model, 10**9, probe_batch_sizes=(8, 16), **kw)
    assert _hooks(model) == 0


def test_blocks_none_follows_the_bytes_across_containers():
    """A diffusers U-Net: with blocks=None the chain runs down, mid and up blocks, in call order, and
    what it chose and left out is said."""
    import zoo_models

    torch.manual_seed(0)
    entry = zoo_models.unet()
    batch = entry.batch(4, seed=0)
    said = []
    opt = torch.optim.AdamW(entry.model.parameters(), lr=1e-3)
    with auto_checkpoint(entry.model, 10**9, example_batch=batch, step_fn=entry.loss, optimizer=opt, policy="full",
                         verbose=False, info=said.append) as handle:
        names = handle.block_names
        mid = [i for i, n in enumerate(names) if n.startswith("mid_block")]  # whole, or its resnets and attentions
        assert [n for n in names if n.startswith("down_blocks")] and mid
        assert [n for n in names if n.startswith("up_blocks")]
        assert min(mid) > max(i for i, n in enumerate(names) if n.startswith("down_blocks"))
    assert any("blocks=None: chose" in m and "left out" in m for m in said)


def test_the_low_level_path_without_static_memory_is_said():
    """Composing the core by hand: a cost without the static memory is planned, with a warning naming
    the way to build the whole step's cost; `step_cost` builds it and plans as auto_checkpoint does."""
    import warnings

    from lightning_ckpt import PartialStepWarning, step_cost

    model, batch = _model(), _batches(1)[0]
    _, names, blocks = resolve_blocks(model, "blocks")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    profile = profile_model(model, blocks, _loss(model), batch, names=names, timing=False)
    with pytest.warns(PartialStepWarning, match=r"static_bytes=0 but trainable parameters.*lightning_ckpt\.step_cost"):
        make_plan(profile.at(BATCH), "optimal", 10**9)
    whole = step_cost(profile, BATCH, static_memory(model, [opt]))  # last step's gradients alive in the forward
    _loss(model)(batch).backward()  # as they are for auto_checkpoint's first plan
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialStepWarning)
        plan = make_plan(whole, "optimal", _budget(_model(), batch), metric="flops")
    with auto_checkpoint(model, _budget(_model(), batch), example_batch=batch, step_fn=_loss(model), optimizer=opt,
                         blocks="blocks", cost_metric="flops", verbose=False) as handle:
        assert handle.plan.segments == plan.segments and handle.plan.predicted_peak_bytes == plan.predicted_peak_bytes


def test_a_step_measured_over_the_budget_is_planned_again_with_the_excess_in_reserve():
    """A loop that measures its steps hands the peak to `handle.measured`: a tensor the step keeps that no
    profile saw puts it over the budget, which is one warning and a new plan at once; the next step fits."""
    batches = _batches(n=1)
    model = _model()
    budget = _budget(model, batches[0])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    measure_step_peak(model, _loss(model), batches[0], opt)  # AdamW's state and last step's gradients exist from here on
    handle = auto_checkpoint(model, budget, example_batch=batches[0], step_fn=_loss(model), optimizer=opt,
                             blocks="blocks", cost_metric="flops", verbose=False)
    kept: list[torch.Tensor] = []
    predicted = handle.plan.predicted_peak_bytes
    full = make_plan(handle.engine.cost, "full").predicted_peak_bytes
    unseen = budget - predicted + (predicted - full) // 2  # over the budget by half the plan's room above `full`

    def keeping(batch):  # keeps a tensor of `unseen` bytes alive until its next step
        kept[:] = [torch.zeros(unseen // 4)]
        return _loss(model)(batch)

    peaks = []
    for first in (True, False):
        handle.step(batches[0])
        peaks.append(measure_step_peak(model, keeping, batches[0], opt))
        over = pytest.warns(UserWarning, match=r"OVER THE MEMORY BUDGET .* Re-planned that shape") if first else nullcontext()
        with over:
            verdict = handle.measured(peaks[-1])
    handle.remove()
    assert peaks[0] > budget >= peaks[1] and not verdict.over
    assert handle.engine.reserves.held(verdict.shape) == verdict.reserve_bytes >= unseen
