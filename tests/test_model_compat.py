"""`prepare_model` on models as their libraries configure them: HF caches off for the fit and back after,
HF's own checkpointing taken over and restored exactly, hazards reported, torch's CheckpointError
explained; plans on the prepared models train bit-identically to the unplanned models, with no growth of
live bytes from step to step."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError
from torch.utils.flop_counter import FlopCounterMode
from zoo_models import ZOO, ZooModel, llama, lora_llama, t5

from lightning_ckpt import apply_segments
from lightning_ckpt.profiling.structure.block_calls import call_chain
from lightning_ckpt.profiling.forward_state.state import preserved_state
from lightning_ckpt.apply.recompute_errors import RecomputeMismatchError, explain_checkpoint_error, explained_checkpoint_errors
from lightning_ckpt.engine.model_prep import ModelCompatWarning, prepare_model
from lightning_ckpt.profiling.forward_state.forward_hazards import forward_hazards, live_bytes_per_step

STEPS = 7


def _build(builder, **kw) -> ZooModel:
    torch.manual_seed(0)
    return builder(**kw)


def _train(entry: ZooModel, steps: int = STEPS, track: bool = True) -> tuple[list[float], tuple[int, ...]]:
    """AdamW steps on batches 0, 1, 2, 0, ... with dropout on; the losses and the live bytes after each step
    (none without `track`)."""
    params = [p for p in entry.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    batches = [entry.batch(4, seed=s) for s in range(3)]
    losses = []
    entry.model.train()
    torch.manual_seed(123)  # the same dropout stream in every run

    def step(i: int) -> None:
        loss = entry.loss(batches[i % len(batches)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a float: a kept tensor would count as growth

    if not track:
        for i in range(steps):
            step(i)
        return losses, ()
    return losses, live_bytes_per_step(step, steps)


def _use_cache(model: nn.Module) -> list[bool]:
    configs = {id(c): c for m in model.modules() if hasattr(c := m.__dict__.get("config"), "use_cache")}
    return [c.use_cache for c in configs.values()]


def _quiet_prepare(model: nn.Module, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = prepare_model(model, **kw)
    return prepared, [w for w in caught if issubclass(w.category, ModelCompatWarning)]


# segments of several blocks over each model's chain; the LoRA Llama nests one inside another
PLANS = {
    "t5": (lambda: t5(layers=4), [(0, 1), (2, 3)], []),
    "llama": (lambda: llama(layers=8, attention_dropout=0.1), [(0, 2), (3, 4), (6, 7)], []),
    "lora_llama": (lambda: lora_llama(layers=4, attention_dropout=0.1), [(0, 3)], [(1, 2)]),
}


def test_t5_as_configured_fails_in_backward_and_the_error_names_the_cache():
    entry = _build(t5, layers=4)
    _, blocks = entry.blocks()
    apply_segments(blocks, [(0, 1), (2, 3)])
    with pytest.raises(CheckpointError, match="different number of tensors was saved"):
        entry.loss(entry.batch()).backward()
    with pytest.raises(RecomputeMismatchError, match=r"(?s)use_cache=True in the HF configs of T5ForConditionalGeneration, "
                       r"T5Stack at 'decoder'.*prepare_model\(model\)") as info:
        with explained_checkpoint_errors(entry.model):
            entry.loss(entry.batch()).backward()
    assert isinstance(info.value.__cause__, CheckpointError)


def test_llama_as_configured_fails_in_the_recompute_and_the_error_names_the_block():
    entry = _build(llama, layers=4)
    _, blocks = entry.blocks()
    apply_segments(blocks, [(0, 1), (2, 3)])
    with pytest.raises(RecomputeMismatchError, match=r"(?s)checkpointed block \(LlamaDecoderLayer at 'model.layers.\d'\)"
                       r".*the HF config of LlamaForCausalLM"):
        with explained_checkpoint_errors(entry.model):
            entry.loss(entry.batch()).backward()


@pytest.mark.parametrize("name", list(PLANS))
def test_prepared_models_train_bit_identical_to_unplanned_without_growth(name):
    builder, segments, inner = PLANS[name]
    reference, _ = _train(_build(builder), track=False)  # as configured (use_cache=True), no plan: it trains

    entry = _build(builder)
    before = _use_cache(entry.model)
    assert True in before
    prepared, caught = _quiet_prepare(entry.model)
    assert len(caught) == 1 and "use_cache=False" in str(caught[0].message)
    assert prepared.use_cache_off and prepared.may_apply and True not in _use_cache(entry.model)
    _, blocks = entry.blocks()
    handle = apply_segments(blocks, segments, inner_segments=inner)
    with explained_checkpoint_errors(entry.model):
        losses, live = _train(entry)
    handle.remove()
    assert len(losses) == len(reference) == STEPS
    assert losses == reference
    assert len(set(live[1:])) == 1, live  # gradients and AdamW state exist after the first step; nothing grows
    prepared.restore()
    assert _use_cache(entry.model) == before and prepared.restored
    prepared.restore()  # once only
    assert _use_cache(entry.model) == before


@pytest.mark.parametrize("name", ["bert", "gpt_neox"])
def test_use_cache_is_off_for_the_fit_whatever_is_decoder_says(name):
    """GPT-NeoX's config says `is_decoder=False` and its forward fills a cache all the same; BERT's says the
    same and ignores the flag: both have `use_cache` off for the fit, said once, and back after."""
    from zoo_models import gpt_neox

    entry = _build({"bert": ZOO["bert"], "gpt_neox": gpt_neox}[name])
    assert entry.model.config.is_decoder is False and entry.model.config.use_cache is True
    prepared, caught = _quiet_prepare(entry.model)
    assert len(caught) == 1 and "use_cache=False" in str(caught[0].message)
    assert prepared.use_cache_off and entry.model.config.use_cache is False
    prepared.restore()
    assert entry.model.config.use_cache is True


def _flags(model: nn.Module) -> list[tuple[str, bool, object]]:
    return [(n, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
            for n, m in model.named_modules() if isinstance(m.__dict__.get("gradient_checkpointing"), bool)]


def _enable_hf(model: nn.Module, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it activation_checkpointing_enable
        model.gradient_checkpointing_enable(**kw)


class Counting(functools.partial):
    """HF's checkpoint function (a partial of torch's) that also counts its calls in `calls`."""

    def __call__(self, *args, **kwargs):
        self.calls.append(1)
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_hf_checkpointing_is_taken_over_for_the_fit_and_restored_exactly(name):
    builder, segments, _ = PLANS[name]
    reference, _ = _train(_build(builder), track=False)
    entry = _build(builder)
    _enable_hf(entry.model, gradient_checkpointing_kwargs={"use_reentrant": False})
    calls: list = []
    for _, m in entry.model.named_modules():
        if m.__dict__.get("gradient_checkpointing") is True:
            func = m._gradient_checkpointing_func
            m._gradient_checkpointing_func = Counting(func.func, *func.args, **func.keywords)
            m._gradient_checkpointing_func.calls = calls
    flags = _flags(entry.model)
    assert entry.model.is_activation_checkpointing

    prepared, caught = _quiet_prepare(entry.model)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "use_cache=False" in messages[0]
    assert "HF activation checkpointing was on in" in messages[1] and "every layer, use_reentrant=False" in messages[1]
    assert prepared.hf_checkpointing == "every layer, use_reentrant=False" and prepared.may_apply
    assert not entry.model.is_activation_checkpointing

    _, blocks = entry.blocks()
    handle = apply_segments(blocks, segments)
    losses, live = _train(entry)
    handle.remove()
    assert losses == reference and len(set(live[1:])) == 1
    assert calls == []  # HF's checkpointing did not run under the plan

    prepared.restore()
    assert _flags(entry.model) == flags and entry.model.is_activation_checkpointing
    entry.loss(entry.batch()).backward()
    assert calls  # HF's own checkpointing runs again, with its own function


def test_every_n_layers_and_peft_restored_exactly():
    entry = _build(lora_llama, layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        entry.model.base_model.model.activation_checkpointing_enable(every_n_layers=2)
    flags = _flags(entry.model)
    hooks = list(entry.model.base_model.model._require_grads_hooks)
    prepared, caught = _quiet_prepare(entry.model)
    assert "2 of 4 layers" in prepared.hf_checkpointing and "LlamaForCausalLM at 'base_model.model'" in str(caught[-1].message)
    assert not any(on for _, on, _ in _flags(entry.model))
    prepared.restore()
    assert _flags(entry.model) == flags and entry.model.base_model.model._require_grads_hooks == hooks


def test_keep_hf_checkpointing_leaves_it_in_charge():
    entry = _build(t5)
    _enable_hf(entry.model)
    flags = _flags(entry.model)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelCompatWarning)  # everything goes through `warn`
        prepared = prepare_model(entry.model, keep_hf_checkpointing=True, warn=seen.append)
    assert not prepared.may_apply and prepared.hf_checkpointing_kept and _flags(entry.model) == flags
    assert len(seen) == 2 and "stays in charge (keep_hf_checkpointing=True)" in seen[1]
    with prepared:
        assert True not in _use_cache(entry.model)
    assert True in _use_cache(entry.model) and _flags(entry.model) == flags


def test_hazards_it_can_only_report():
    entry = _build(t5)
    entry.model.config.output_hidden_states = True
    entry.model.decoder.config.layerdrop = 0.1
    entry.model.lm_head = nn.utils.parametrizations.spectral_norm(entry.model.lm_head)
    prepared, _ = _quiet_prepare(entry.model)
    text = "\n".join(prepared.hazards)
    assert len(prepared.hazards) == 2  # spectral norm is no hazard: the state guard replays its vectors
    assert "output_hidden_states=True in the HF config of T5ForConditionalGeneration" in text
    # LayerDrop is said with what the plan does about it
    assert "LayerDrop is on (decoder.config.layerdrop=0.1)" in text and "checkpoints each block on its own" in text
    assert "spectral" not in text
    prepared.restore()


class Stateful(nn.Module):
    """Counts its calls, writes a buffer in place, keeps its last output and a list of inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.register_buffer("ema", torch.zeros(4))
        self.calls, self.last, self.seen = 0, None, []

    def forward(self, x):
        self.calls += 1
        self.ema.mul_(0.9).add_(x.mean(0).detach())
        self.last = y = self.norm(self.lin(x))
        self.seen.append(x)
        return y


def test_forward_hazards_finds_state_a_forward_changes_and_puts_it_back():
    model = nn.Sequential(Stateful())
    found = forward_hazards(model, lambda: model(torch.randn(3, 4)))
    text = "\n".join(found)
    assert len(found) == 4, found
    assert "Stateful at '0' writes its buffer 'ema'" in text and "changes its attribute 'calls' in its forward (0 -> 1)" in text
    assert "keeps a tensor in its attribute 'last'" in text and "adds tensors to its attribute 'seen'" in text
    assert model[0].calls == 0 and torch.equal(model[0].ema, torch.zeros(4))  # put back; BatchNorm not reported


# FLOPs of one step at batch 4 (matmuls, convolutions, attention): the zoo's configs are tiny, so every
# test that trains them stays cheap. The largest, the U-Net, takes about 6.2 GFLOP, the zoo's T5 0.03;
# T5 at `T5Config()`'s own sizes (t5-small) would take 23.
STEP_FLOPS = 10**10


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_train_a_step_quickly_with_nothing_to_report(name):
    """Quickly as work done: a tiny model (FLOPs counted), and a prepared model's plain step recomputes
    nothing (no module's forward runs in its backward)."""
    entry = _build(ZOO[name])
    prepared, _ = _quiet_prepare(entry.model)
    names, blocks = entry.blocks()
    with preserved_state(entry.model):  # a module called several times per step is a block per call
        blocks, names = call_chain(entry.model, blocks, names, entry.loss, entry.batch(2))
    assert len(blocks) >= 3 and prepared.hazards == ()
    found = forward_hazards(entry.model, lambda: entry.loss(entry.batch(2)))
    if name == "swin":  # HF's SwinLayer sets `shift_size` to 0 where the window covers the image: reported, kept
        assert len(found) == 1 and "changes its attribute 'shift_size' in its forward (1 -> 0)" in found[0], found
    else:
        assert found == ()
    opt = torch.optim.AdamW([p for p in entry.model.parameters() if p.requires_grad])
    again = []  # [recompute] module forwards run in the backward
    hooks = [m.register_forward_pre_hook(lambda m, a: again.append(m) if backward_running[0] else None)
             for m in entry.model.modules()]
    backward_running = [False]
    with FlopCounterMode(display=False) as forward:
        loss = entry.loss(entry.batch(4))
    backward_running[0] = True
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    backward_running[0] = False
    for h in hooks:
        h.remove()
    opt.step()
    fwd, bwd = forward.get_total_flops(), backward.get_total_flops()
    assert 0 < fwd and fwd + bwd <= STEP_FLOPS, (fwd, bwd)
    assert again == [], again[:3]
    prepared.restore()


def test_explain_leaves_other_errors_alone_and_explains_a_twice_unpacked_region():
    other = ValueError("not about checkpointing")
    assert explain_checkpoint_error(other) is other
    twice = CheckpointError("torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once.")
    explained = explain_checkpoint_error(twice)
    assert isinstance(explained, RecomputeMismatchError) and explained.__cause__ is twice
    assert "retain_graph=True" in str(explained)
    assert explain_checkpoint_error(explained) is explained


def test_an_error_raised_inside_a_recompute_is_explained_without_a_model():
    class FailsSecondTime(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.calls = nn.Linear(4, 4), 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("second call")
            return torch.tanh(self.lin(x))

    blocks = [FailsSecondTime(), FailsSecondTime()]
    apply_segments(blocks, [(0, 1)])
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RecomputeMismatchError, match=r"(?s)block \(FailsSecondTime\) did not repeat its forward \(second call\)"
                       r".*HF models with config.use_cache=True.*Python state"):
        with explained_checkpoint_errors():
            blocks[1](blocks[0](x)).sum().backward()
