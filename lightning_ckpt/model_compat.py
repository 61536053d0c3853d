"""Make a model's forward repeatable before it is profiled and checkpointed, and explain it when it is not.

    prepared = prepare_model(model, keep_hf_checkpointing=False, warn=None)   # before profiling
    prepared.may_apply       # False when HF's own checkpointing stays in charge: apply no plan
    prepared.restore()       # when the fit ends (or `with prepare_model(model) as prepared:`)
    forward_hazards(model, run) -> tuple[str, ...]               # run a forward, report state it changes
    explain_checkpoint_error(err, model=None) -> BaseException   # torch's CheckpointError made clear
    explained_checkpoint_errors(model=None)                      # the same, as a context manager
    live_bytes_per_step(step, n_steps) -> tuple[int, ...]        # live bytes growing step to step

`prepare_model` sets `use_cache=False` in every HF config of the tree (`module.config`, through peft's
wrappers, sub-configs) of a model that fills a key/value cache (decoders, encoder-decoders; BERT-style
encoders never do): the cache grows on every call, so a recompute sees other shapes (torch's "different
number of tensors" error, or a shape error) and the cache keeps each step's keys and values alive. It
turns HF's (and diffusers') own activation checkpointing off through the model's disable method; `restore`
puts back each module's flag and checkpoint function (so the kwargs, `every_n_layers` and offloading
come back) and the input embeddings' require-grad hook. It reports, without changing them
(`Prepared.hazards`): `output_attentions` / `output_hidden_states` (every layer's maps or outputs stay
alive to the loss), LayerDrop (a skipped layer breaks a segment of several blocks) and spectral norm (its
power iteration updates buffers again in a recompute). `forward_hazards` finds by running a forward:
buffers written in place outside normalization layers (whose statistics `apply` guards), Python
attributes that change, and tensors kept on modules (alive past their block, so never freed).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

__all__ = [
    "ModelCompatWarning", "Prepared", "RecomputeMismatchError", "explain_checkpoint_error",
    "explained_checkpoint_errors", "forward_hazards", "live_bytes_per_step", "prepare_model",
]

# the models' own disable methods, newest name first (transformers 5, transformers 4 / peft, diffusers)
_DISABLE_METHODS = ("activation_checkpointing_disable", "gradient_checkpointing_disable", "disable_gradient_checkpointing")
_LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
_MISSING = object()
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")


class ModelCompatWarning(UserWarning):
    """lightning-ckpt changed a setting of the model for the fit (it is set back at the end)."""


class RecomputeMismatchError(CheckpointError):
    """The recompute of a checkpointed block did not repeat its forward."""


def _name(path: str, module: nn.Module) -> str:
    return f"{type(module).__name__} at {path!r}" if path else type(module).__name__


def _is_config(obj: Any) -> bool:
    """A HF config by duck type: `to_dict` and `model_type` (no transformers import)."""
    return callable(getattr(obj, "to_dict", None)) and hasattr(obj, "model_type")


def _configs(model: nn.Module) -> list[tuple[str, Any]]:
    """(whose, config) for every distinct HF config of the tree and their sub-configs; a module's own
    `config` names it before a wrapper that forwards attribute lookups to it (peft's)."""
    found: dict[int, tuple[str, Any]] = {}

    def add(whose: str, cfg: Any) -> None:
        if id(cfg) in found:
            return
        found[id(cfg)] = (whose, cfg)
        for key, value in list(vars(cfg).items()):
            if _is_config(value):
                add(f"{whose} ({key})", value)

    modules = list(model.named_modules())
    for path, module in modules:
        if _is_config(module.__dict__.get("config")):
            add(_name(path, module), module.__dict__["config"])
    for path, module in modules:
        try:
            cfg = getattr(module, "config", None)
        except Exception:  # a property that fails on a partly built module
            continue
        if _is_config(cfg):
            add(_name(path, module), cfg)
    return list(found.values())


def _fills_cache(cfg: Any) -> bool:
    """`use_cache=True` in a config whose forward fills a key/value cache: an encoder-decoder, a decoder,
    or a decoder-only family (no `is_decoder` switch). BERT-style encoders (`is_decoder=False`) never do."""
    if getattr(cfg, "use_cache", None) is not True:
        return False
    return bool(getattr(cfg, "is_encoder_decoder", False)) or getattr(cfg, "is_decoder", None) in (True, None)


def _configs_of(names: list[str]) -> str:
    return ("the HF config of " if len(names) == 1 else "the HF configs of ") + ", ".join(names)


def _uses_spectral_norm(module: nn.Module) -> bool:
    from torch.nn.utils.spectral_norm import SpectralNorm

    if any(isinstance(h, SpectralNorm) for h in module._forward_pre_hooks.values()):
        return True
    params = getattr(module, "parametrizations", None)
    return params is not None and any(type(p).__name__ == "_SpectralNorm" for ps in params.values() for p in ps)


def _static_hazards(model: nn.Module, configs: list[tuple[str, Any]]) -> list[str]:
    found = []
    for where, cfg in configs:
        for key, what in (("output_attentions", "attention maps"), ("output_hidden_states", "outputs")):
            if getattr(cfg, key, False) is True:
                found.append(f"{key}=True in {_configs_of([where])}: the forward returns every layer's {what}, which "
                             "stay alive to the loss, so checkpointing frees less than planned; set it False for "
                             "training unless the loss needs them")
        for key in _LAYERDROP:
            if isinstance(getattr(cfg, key, 0), (int, float)) and getattr(cfg, key, 0) > 0:
                found.append(f"{key}={getattr(cfg, key)} in {_configs_of([where])}: LayerDrop skips layers at random "
                             "in training, and a segment of several blocks fails when one is skipped; plan one block "
                             "per segment (policy='full') or set it to 0")
    for path, module in model.named_modules():
        if _uses_spectral_norm(module):
            found.append(f"{_name(path, module)} uses spectral norm: its power iteration updates buffers in every "
                         "training forward, so a recompute updates them again and computes with other weights "
                         "(gradients differ from training without checkpointing); keep the block that holds it")
    return found



def _flag_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m.__dict__.get("gradient_checkpointing"), bool)]


def _describe_checkpointing(flagged: list[tuple[str, nn.Module]]) -> str:
    """`every layer, use_reentrant=False` or `3 of 6 layers, ...`, from the flags and checkpoint function."""
    mods = [m for _, m in flagged]
    layers = [m for m in mods if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)] or mods
    on = [m for m in layers if m.gradient_checkpointing]
    parts = ["every layer" if len(on) == len(layers) else f"{len(on)} of {len(layers)} layers"]
    func = next((m.__dict__.get("_gradient_checkpointing_func") for m in mods if m.gradient_checkpointing), None)
    inner = func.func if isinstance(func, functools.partial) else func
    if isinstance(func, functools.partial) and func.keywords:
        parts.append(", ".join(f"{k}={v!r}" for k, v in func.keywords.items()))
    if "save_on_cpu" in getattr(getattr(inner, "__code__", None), "co_names", ()):
        parts.append("saved activations offloaded to the CPU")
    elif inner is not None and inner is not torch.utils.checkpoint.checkpoint:
        parts.append(f"through {getattr(inner, '__qualname__', 'a custom checkpoint function')}")
    return ", ".join(parts)


def _owners(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, module, disable method) of the outermost modules whose class has a disable method."""
    owners: list[tuple[str, nn.Module, str]] = []
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") or not p for p, _, _ in owners):
            continue
        method = next((n for n in _DISABLE_METHODS if callable(getattr(type(module), n, None))), None)
        if method is not None and any(isinstance(m.__dict__.get("gradient_checkpointing"), bool) for m in module.modules()):
            owners.append((path, module, method))
    return owners


@dataclass
class Prepared:
    """What `prepare_model` changed and found. `restore()` undoes the changes (once; idempotent).

    `use_cache_off`: where `use_cache` was turned off. `hf_checkpointing`: HF's own checkpointing as found
    (a description) or None. `hf_checkpointing_kept`: left on (`keep_hf_checkpointing=True`); then
    `may_apply` is False and a plan must not be applied on top. `hazards`: what it can only report.
    `messages`: the warnings it gave."""

    use_cache_off: tuple[str, ...] = ()
    hf_checkpointing: str | None = None
    hf_checkpointing_kept: bool = False
    hazards: tuple[str, ...] = ()
    messages: tuple[str, ...] = ()
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def may_apply(self) -> bool:
        """Whether a lightning-ckpt plan may be applied (not when HF's checkpointing stays on)."""
        return not self.hf_checkpointing_kept

    @property
    def restored(self) -> bool:
        return not self._undo

    def restore(self) -> None:
        """Put every changed setting back as it was, last change first."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _warn(message: str) -> None:
    warnings.warn(message, ModelCompatWarning, stacklevel=3)


def prepare_model(
    model: nn.Module, *, keep_hf_checkpointing: bool = False, warn: Callable[[str], None] | None = None
) -> Prepared:
    """Make `model`'s forward repeatable for training with lightning-ckpt; see the module docstring.

    At most one warning for the caches and one for HF's checkpointing, through `warn` (default:
    `warnings.warn` with `ModelCompatWarning`; a Lightning front end passes `rank_zero_warn`)."""
    warn = warn or _warn
    configs = _configs(model)
    undo: list[Callable[[], None]] = []
    messages: list[str] = []

    cached = [(where, cfg) for where, cfg in configs if _fills_cache(cfg)]
    for _, cfg in cached:
        cfg.use_cache = False
        undo.append(functools.partial(setattr, cfg, "use_cache", True))
    if cached:
        messages.append(
            f"lightning-ckpt: set use_cache=False for training in {_configs_of([w for w, _ in cached])}: with "
            "use_cache=True the forward fills a key/value cache that every call extends, so the recompute of a "
            "checkpointed block sees longer keys than its forward did (torch's 'different number of tensors was saved' "
            "CheckpointError or a shape error in backward) and the cache keeps each step's keys and values alive. HF's "
            "own gradient checkpointing turns it off for the same reason. It is set back to True when the fit ends."
        )

    flagged, owners = _flag_modules(model), _owners(model)
    described = _describe_checkpointing(flagged) if any(m.gradient_checkpointing for _, m in flagged) else None
    kept = bool(described) and keep_hf_checkpointing
    whose = ", ".join(_name(path, owner) for path, owner, _ in owners) or type(model).__name__
    if described and kept:
        messages.append(
            f"lightning-ckpt: HF activation checkpointing is on in {whose} ({described}) and stays in charge "
            "(keep_hf_checkpointing=True): lightning-ckpt profiles and reports but applies no plan of its own."
        )
    elif described:
        undo.extend(_disable_hf_checkpointing(flagged, owners))
        messages.append(
            f"lightning-ckpt: HF activation checkpointing was on in {whose} ({described}); it is turned off for "
            "this fit, where lightning-ckpt plans which blocks to checkpoint, and turned back on as it was when the "
            "fit ends. Pass keep_hf_checkpointing=True to leave HF's in charge (then no plan is applied)."
        )
    for message in messages:
        warn(message)
    return Prepared(
        use_cache_off=tuple(w for w, _ in cached), hf_checkpointing=described, hf_checkpointing_kept=kept,
        hazards=tuple(_static_hazards(model, configs)), messages=tuple(messages), _undo=undo,
    )


def _disable_hf_checkpointing(
    flagged: list[tuple[str, nn.Module]], owners: list[tuple[str, nn.Module, str]]
) -> list[Callable[[], None]]:
    """Turn the flags off through the owners' own methods; return the undo steps."""
    saved = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func", _MISSING)) for _, m in flagged]
    hooks = [(o, list(getattr(o, "_require_grads_hooks", None) or ())) for _, o, _ in owners]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecates the gradient_* names
        for _, owner, method in owners:
            getattr(owner, method)()
    for _, module in flagged:  # a flag no owner's method reaches
        module.gradient_checkpointing = False

    def put_back() -> None:
        for module, flag, func in saved:
            module.gradient_checkpointing = flag
            if func is not _MISSING:
                module._gradient_checkpointing_func = func
        for owner, before in hooks:
            if before and not getattr(owner, "_require_grads_hooks", None):
                owner.enable_input_require_grads()  # HF's disable removed the input embeddings' hook

    return [put_back]


def _plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def _holds_tensors(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(v, torch.Tensor) for v in items)


def _snapshot(module: nn.Module) -> tuple[dict[str, tuple], dict[str, tuple[int, int, torch.Tensor]]]:
    attrs: dict[str, tuple] = {}
    for key, value in vars(module).items():
        if key in _MODULE_DICTS:
            continue
        if _plain(value):
            attrs[key] = ("plain", value)
        elif isinstance(value, torch.Tensor):
            attrs[key] = ("tensor", id(value))
        elif isinstance(value, (list, dict)):
            attrs[key] = ("container", len(value))
    buffers = {} if isinstance(module, nn.modules.batchnorm._NormBase) else {
        key: (id(buf), buf._version, buf.detach().clone()) for key, buf in module._buffers.items() if buf is not None
    }
    return attrs, buffers


def forward_hazards(model: nn.Module, run: Callable[[], Any]) -> tuple[str, ...]:
    """Call `run()` (one forward of `model`, or a whole step) and report what it changed that a recompute
    would change again or that keeps tensors alive: buffers written in place outside normalization layers,
    plain Python attributes (numbers, strings, flags), tensors and lists or dicts of tensors stored on
    modules. Buffers and Python attributes are put back afterwards; the model's outputs are discarded."""
    before = [(path, module, *_snapshot(module)) for path, module in model.named_modules()]
    try:
        run()
    finally:
        found = []
        for path, module, attrs, buffers in before:
            where = _name(path, module)
            for key, (id_, version, copy) in buffers.items():
                buf = module._buffers.get(key)
                if buf is not None and (id(buf) != id_ or buf._version != version):
                    found.append(f"{where} writes its buffer {key!r} in its forward: a recompute writes it again "
                                 "(and may compute with the new value); keep this block or make the update idempotent")
                    with torch.no_grad():
                        if id(buf) == id_:
                            buf.copy_(copy)
                        else:
                            module._buffers[key] = copy
            for key, value in vars(module).items():
                kind, old = attrs.get(key, (None, None))
                if kind == "plain" and _plain(value) and old != value:
                    found.append(f"{where} changes its attribute {key!r} in its forward ({old!r} -> {value!r}): a "
                                 "recompute changes it again and may take another path")
                    setattr(module, key, old)
                elif isinstance(value, torch.Tensor) and (kind, old) != ("tensor", id(value)):
                    found.append(f"{where} keeps a tensor in its attribute {key!r}: it stays alive past the block (and "
                                 "the step), so checkpointing cannot free it")
                elif kind == "container" and isinstance(value, (list, dict)) and len(value) != old and _holds_tensors(value):
                    found.append(f"{where} adds tensors to its attribute {key!r} in its forward: they stay alive past the "
                                 "block (and the step), so checkpointing cannot free them")
    return tuple(found)


def live_bytes_per_step(step: Callable[[int], Any], n_steps: int) -> tuple[int, ...]:
    """Bytes of the tensor storages made from the first call on and still alive after each of `n_steps`
    calls `step(0)`, `step(1)`, ... (counted by `LiveBytesTracker`, after a garbage collection). A training
    step that keeps nothing settles after its first step or two (gradients and optimizer state exist);
    a rise every step means something keeps each step's tensors alive."""
    from lightning_ckpt.profiling.tracker import LiveBytesTracker

    live = []
    with LiveBytesTracker() as tracker:
        for i in range(n_steps):
            step(i)
            gc.collect()
            live.append(tracker.live_bytes)
    return tuple(live)



def _recompute_frames(err: BaseException) -> list[Any] | None:
    """The frames below torch's recompute, innermost last; None when `err` was not raised in one."""
    tb, frames, inside = err.__traceback__, [], False
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "recompute_fn" and code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            inside, frames = True, []
        elif inside:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames if inside else None


def _module_of(frames: list[Any], model: nn.Module | None) -> str | None:
    """The outermost module whose forward ran under the recompute, by name when `model` holds it."""
    for frame in frames:
        module = frame.f_locals.get("self")
        if isinstance(module, nn.Module) and frame.f_code.co_name == "forward":
            if model is not None:
                for path, m in model.named_modules():
                    if m is module:
                        return _name(path, m)
            return type(module).__name__
    return None


def explain_checkpoint_error(err: BaseException, model: nn.Module | None = None) -> BaseException:
    """A `RecomputeMismatchError` (a CheckpointError) naming the likely cause and the fix, for torch's
    CheckpointError or any error raised inside a recompute; any other error is returned unchanged.
    With `model`, its HF configs that still have `use_cache=True` are named."""
    if isinstance(err, RecomputeMismatchError):
        return err
    frames = _recompute_frames(err)
    if not isinstance(err, CheckpointError) and frames is None:
        return err
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    where = _module_of(frames or [], model)
    what = f"the recompute of a checkpointed block{f' ({where})' if where else ''} did not repeat its forward ({first})"
    if "already unpacked once" in str(err):
        causes = [
            "a backward ran twice through the same checkpointed region (retain_graph=True, or a second loss backward "
            "through the same forward) or a custom autograd Function reads ctx.saved_tensors twice; fix: keep those "
            "blocks (do not checkpoint them) or run one backward per forward"
        ]
    else:
        causes = []
        cached = [w for w, cfg in (_configs(model) if model is not None else []) if _fills_cache(cfg)]
        if cached:
            causes.append(
                f"use_cache=True in {_configs_of(cached)}: the forward fills a key/value cache that the recompute "
                "extends again; fix: call lightning_ckpt.model_compat.prepare_model(model) before training (it turns "
                "use_cache off for the fit), or set config.use_cache = False"
            )
        elif model is None:
            causes.append(
                "a cache the forward fills (HF models with config.use_cache=True: every call extends the key/value "
                "cache); fix: prepare_model(model) before training, or set config.use_cache = False"
            )
        causes.append(
            "a forward that differs between runs: it reads or changes Python state (a counter, a flag set on the "
            "first call, Python's `random`), or tensors it stored on a module; fix: make the block depend only on its "
            "inputs, parameters and torch's RNG, or keep that block (forward_hazards(model, run) lists such state)"
        )
    lines = [what + "."] + [f"Likely cause {i}: {c}." for i, c in enumerate(causes, 1)]
    new = RecomputeMismatchError("\n".join(lines))
    new.__cause__ = err
    return new


@contextlib.contextmanager
def explained_checkpoint_errors(model: nn.Module | None = None) -> Iterator[None]:
    """Re-raise what `explain_checkpoint_error` turns into a `RecomputeMismatchError`; others pass through."""
    try:
        yield
    except Exception as err:
        explained = explain_checkpoint_error(err, model)
        if explained is err:
            raise
        raise explained from err
