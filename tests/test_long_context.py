"""One long sequence per step: HF Llama at batch (1, L) and packed rows from `DataCollatorWithFlattening`,
profiled along the tokens (prefixes of the sequence that fit the budget, a quadratic in the length checked
on a held-out length), every step within the budget, profiling within it by malloc, losses bit-identical."""

from __future__ import annotations


import pytest
import torch
from test_profile_budget import WITHIN, _held, heap_peak, kept_timings  # noqa: F401 - a fixture
from models import steps_with_peaks
from zoo_models import llama

from lightning_ckpt import auto_checkpoint, make_plan, measure_step_peak
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.planning.policies import InfeasibleBudgetError
from lightning_ckpt.engine.target_plan import cost_at
from lightning_ckpt.profiling.structure.blocks import resolve_blocks
from lightning_ckpt.profiling.structure.shapes import sequence_positions, shape_of, slice_length
from lightning_ckpt.profiling.memory.static_memory import static_memory

MiB = 2**20
BLOCKS = "model.layers"


def _llama():
    torch.manual_seed(0)
    return llama(layers=4, hidden=64).model  # use_cache=True, as the config ships


def _ids(length: int, seed: int = 0) -> dict:
    ids = torch.randint(2, 96, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _packed(lengths: list[int], seed: int = 0) -> dict:
    """Examples of `lengths` tokens flattened into one row, `position_ids` restarting at each."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    examples = [{"input_ids": torch.randint(2, 96, (n,), generator=g).tolist()} for n in lengths]
    return dict(DataCollatorWithFlattening(return_tensors="pt")(examples))


def _budget(model, batch, share: float) -> int:
    """`share` of the way from the `full` plan's peak to the `none` one's at the batch of one sample."""
    _, names, blocks = resolve_blocks(model, BLOCKS)
    use_cache, model.config.use_cache = model.config.use_cache, False
    # timed: the machine's rates are measured here once and kept (`kept_timings`), not inside what is measured
    profile = profile_model(model, blocks, lambda b: model(**b).loss, batch, names=names, timing=True,
                            calibrate_keeps=False)
    model.config.use_cache = use_cache
    cost = cost_at(profile, 1, static_memory(model, [torch.optim.AdamW(model.parameters())]))
    full, none = (make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
    return int(full + share * (none - full))


def _train(model, batches, handle=None) -> tuple[list[torch.Tensor], list[int]]:
    """Each batch's step measured, then trained (`steps_with_peaks`)."""
    return steps_with_peaks(model, lambda b: model(**b).loss, batches, handle)


def test_the_token_dimension_of_one_packed_row_is_found_and_its_prefix_is_a_packed_row():
    batch = _packed([5, 3, 4])
    batch["cu_seq_lens_q"] = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    positions = sequence_positions(shape_of(batch))
    assert positions == ((0, 1), (1, 1), (2, 1))  # input_ids, labels, position_ids; not the index
    part = slice_length(batch, positions, 7)
    assert part["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert part["input_ids"].tolist() == [batch["input_ids"][0, :7].tolist()]
    assert part["cu_seq_lens_q"].tolist() == [0, 5, 7]  # the index of where each example starts, cut too


def test_auto_checkpoint_plans_one_llama_sequence_too_long_to_profile_whole_within_the_budget(kept_timings):
    """Unplanned, the sequence of 512 tokens holds more than the budget: after its prefixes, it is profiled
    whole under checkpointing, within the budget, and planned from that profile."""
    model, length = _llama(), 512
    batches = [_ids(length, seed) for seed in range(3)]
    budget = _budget(_llama(), batches[0], 0.3)
    ref_losses, ref_peaks = _train(_llama(), batches)
    assert max(ref_peaks) > budget  # without checkpointing it does not fit
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lines: list[str] = []
    with heap_peak(_held(model, [opt], batches[0])) as found:
        handle = auto_checkpoint(model, budget, example_batch=batches[0], step_fn=lambda b: model(**b).loss,
                                 optimizer=opt, blocks=BLOCKS, cost_metric="flops", verbose=False, info=lines.append)
    assert found[0] <= WITHIN * budget, f"profiling peaked at {found[0] / MiB:.2f} MiB, budget {budget / MiB:.2f} MiB"
    decision = next(iter(handle.engine._shapes.plans.values()))
    assert decision.source == "profiled" and max(decision.profiled_lengths) == length
    assert any("profiled under checkpointing" in line for line in lines), lines
    assert handle.plan.fits and handle.plan.checkpointed
    losses, peaks = _train(model, batches, handle)
    assert all(p <= budget for p in peaks), f"steps peaked at {[p / MiB for p in peaks]} MiB, budget {budget / MiB}"
    # (profiled at its own length: predicted as a profiled shape is, with no extrapolation's reserve; 4 bytes
    # short of the measured step here)
    assert abs(handle.plan.predicted_peak_bytes - max(peaks)) <= 0.001 * max(peaks)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    longest = handle.longest_length()  # from the profiles alone: a batch of that length fits as measured
    assert length <= longest < 2 * length
    handle.step(_ids(longest, seed=9))
    runs = handle.engine.profile_runs
    assert measure_step_peak(model, lambda b: model(**b).loss, _ids(longest, seed=9), opt) <= budget
    assert handle.engine.profile_runs == runs
    with pytest.raises(InfeasibleBudgetError, match=rf"longest sequence \(or packed row\) that fits is {longest} tokens"):
        handle.step(_ids(longest + 40, seed=9))
    handle.remove()


def test_packed_rows_of_new_total_lengths_are_costed_from_the_fit_within_the_budget(kept_timings):
    """Rows packed from examples of 20-90 tokens, a different total length each step: after the first
    row (its own length and three prefixes profiled) at most one more profile."""
    rows = [[60, 90, 50, 40], [30, 80, 70], [90, 20, 45, 35, 40], [25, 60, 30], [85, 80, 45]]
    batches = [_packed(r, seed) for seed, r in enumerate(rows)]
    assert len({b["input_ids"].shape[1] for b in batches}) == len(rows)
    budget = _budget(_llama(), batches[0], 0.4)
    plain = _llama()
    # with a key/value cache HF Llama does not see the packing (its attention crosses the examples): the library
    # turns use_cache off in training, so the plain run is trained as HF trains, without it
    plain.config.use_cache = False
    ref_losses, ref_peaks = _train(plain, batches)
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # last step's gradients alive at each forward, as in every step of the loop (zeroed after the forward): the
    # first plan counts them, so no shape is planned again once the loop has made some
    model(**batches[0]).loss.backward()
    handle = auto_checkpoint(model, budget, example_batch=batches[0], step_fn=lambda b: model(**b).loss,
                             optimizer=opt, blocks=BLOCKS, cost_metric="flops", verbose=False)
    runs = handle.engine.profile_runs
    losses, peaks = _train(model, batches, handle)
    sources = [d.source for d in handle.engine._shapes.plans.values()]
    assert handle.engine.profiled_steps <= 2 and len(sources) == len(rows), sources
    assert handle.engine.profile_runs - runs <= 4  # one batch at most, with its prefixes
    assert all(p <= budget for p in peaks), f"steps peaked at {[p / MiB for p in peaks]} MiB, budget {budget / MiB}"
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    handle.remove()


def test_the_callback_plans_batch_size_one_for_one_long_sequence_within_the_budget(kept_timings):
    from hf_models import CausalTokens, LitHF, StepPeaks
    from lit_models import make_trainer

    from lightning_ckpt import ActivationCheckpointing

    data = CausalTokens(batch_size=1, n=3, seq=512)
    budget = _budget(_llama(), next(iter(data.train_dataloader())), 0.3)
    plain, plain_peaks = LitHF(_llama()), StepPeaks()
    make_trainer([plain_peaks], max_steps=3).fit(plain, datamodule=data)
    model, peaks = LitHF(_llama()), StepPeaks()
    cb = ActivationCheckpointing(1, memory_budget=budget, blocks="model.model.layers", cost_metric="flops",
                                 verbose=False, report=False)
    make_trainer([cb, peaks], max_steps=3).fit(model, datamodule=data)
    assert max(plain_peaks.peaks) > budget and cb.plan.batch_size == 1 and cb.plan.checkpointed
    assert all(p <= budget for p in peaks.peaks), f"steps peaked at {[p / MiB for p in peaks.peaks]}, budget {budget / MiB}"
    assert all(torch.equal(a, b) for a, b in zip(model.losses, plain.losses)) and len(model.losses) == 3

