"""`auto_checkpoint`: the callback's planning for a loop you write yourself (plain PyTorch or Fabric).

    handle = auto_checkpoint(model, "6GiB", example_batch=batch, step_fn=lambda b: loss_fn(model, b),
                             optimizer=opt)
    for batch in loader:
        handle.step(batch)                # the plan for this batch's shape (cached after the first)
        step_fn(batch).backward(); opt.step(); opt.zero_grad()
    handle.remove()                       # or `with auto_checkpoint(...) as handle:`

`step_fn(batch)` runs the forward and returns the loss; while profiling the library runs its
backward and puts back every gradient, buffer and RNG stream, so the loop's losses are those of
the same loop without it. Arguments, defaults and errors are the callback's (`cost_metric="time"`).

A training forward whose inputs are larger in some size than any planned one, with no
`handle.step(batch)` before it, is refused before it runs (`check_shapes`): its plan was never made.
A step you measure yourself goes to `handle.measured(peak_bytes)`: over the budget, its shape is
planned again with the excess over the prediction held in reserve (the callback measures for you);
`handle.plan_measured` says when the applied plan has no step measured yet.
What the loop does with its gradients (freed by `zero_grad()`, kept by `zero_grad(set_to_none=False)`,
alive in the forward when zeroed after it) is read from their `.grad` at each `handle.step`; the first
plan counts those there are then, and a loop seen to hold more is planned again before the step runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from lightning_ckpt.engine import arguments
from lightning_ckpt.engine.chain_levels import engine_for_chain, skips_coarser
from lightning_ckpt.engine.checkpoint_engine import CheckpointEngine, EngineSettings
from lightning_ckpt.engine.engine_inputs import reading_room
from lightning_ckpt.engine.measured_steps import MeasuredStep
from lightning_ckpt.frontends.loops.plain_driver import PlainDriver, StepFn
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.profiling.structure.blocks import resolve_blocks
from lightning_ckpt.profiling.structure.discovery import discover_chain
from lightning_ckpt.profiling.forward_state.state import preserved_rng
from lightning_ckpt.profiling.structure.shapes import BatchShape, shape_of
from lightning_ckpt.profiling.memory.static_memory import KNOWN_OPTIMIZERS
from lightning_ckpt.report.summary import plan_summary
from lightning_ckpt.units import parse_bytes


class CheckpointHandle:
    """The plan applied by `auto_checkpoint`: `plan`, `batch_size`, `step(batch)`, `measured(peak)`, `remove()`."""

    def __init__(self, engine: CheckpointEngine, driver: PlainDriver, check_shapes: bool, verbose: bool) -> None:
        self.engine, self._driver, self._verbose = engine, driver, verbose
        self._inputs: list[BatchShape] = []  # model-input shapes of the planned steps, each once
        self._input_set: set[BatchShape] = set()  # the same, to find a shape met before at once
        self._expect = True  # the next training forward is a planned step's: record its inputs
        self._hook = driver.model.register_forward_pre_hook(self._guard, with_kwargs=True) if check_shapes else None

    @property
    def plan(self) -> Plan | None:
        """The applied plan (for the shape of the last `step`)."""
        return self.engine.plan

    @property
    def batch_size(self) -> int | None:
        """The batch size planned for (with ``target_batch_size="max"``: the largest that fits)."""
        return None if self.engine.plan is None else self.engine.plan.batch_size

    @property
    def plans(self) -> dict[BatchShape, Plan]:
        return self.engine.plans

    @property
    def plan_measured(self) -> bool:
        """Whether a step under the applied plan was passed to `measured`: False for a shape's first plan and
        after each re-plan of it, when the next step is the one to measure."""
        return self.engine.plan_measured

    def longest_length(self) -> int | None:
        """The longest sequence (or packed row) that fits the budget at the batch size of the last `step`
        with the best plan, from the profiles alone; None when the length was never fitted."""
        return self.engine.longest_length()

    @property
    def block_names(self) -> list[str]:
        return self.engine.block_names

    def step(self, batch: Any) -> Plan:
        """Apply the plan for `batch`'s shape before its step (profiled and planned the first time a
        shape comes, cached after); collective under `torch.distributed`: call it on every rank. The
        parameters' gradients are read first: a loop seen to hold more of them than its plans count (kept
        between steps, or alive in the forward) is planned again for them (`loop_grads`)."""
        self._driver.observe_grads()
        decision = self.engine.step(batch)
        if decision is not None:
            self._expect = True
            if decision.new and self._verbose:
                self._driver.info(self.engine.describe(decision))
        return self.engine.plan

    __call__ = step

    def measured(self, peak_bytes: int) -> MeasuredStep:
        """Judge a step you measured (e.g. `torch.cuda.max_memory_allocated()` over it, or
        `lightning_ckpt.measure_step_peak`) against the budget: over it, one warning with both numbers, and
        the step's shape is planned again now with the excess over the prediction held in reserve."""
        verdict = self.engine.measured(peak_bytes)
        if verdict.over:
            self._driver.warn(verdict.message())
        return verdict

    def remove(self) -> None:
        """Undo everything: no hook of the library is left on any module, the model's settings are back."""
        self.engine.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _guard(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._driver.profiling or not torch.is_grad_enabled() or not module.training:
            return
        shape = shape_of((args, kwargs))
        if self._expect:
            if shape not in self._input_set:
                self._input_set.add(shape)
                self._inputs.append(shape)
            self._expect = False
            return
        if shape in self._input_set or any(_within(shape, planned) for planned in self._inputs):
            return
        raise RuntimeError(
            f"a training forward of {type(module).__name__} with inputs of shape ({shape.describe()}), larger than "
            f"the planned steps' ({'; '.join(s.describe() for s in self._inputs)}), and no plan was made for it. "
            "Call handle.step(batch) before each training step, so that each new batch shape is planned within "
            "the budget first (or pass check_shapes=False to auto_checkpoint to run unchecked)."
        )


def _within(shape: BatchShape, planned: BatchShape) -> bool:
    return shape.same_layout(planned) and all(
        a <= b for sa, sb in zip(shape.shapes, planned.shapes) for a, b in zip(sa, sb)
    )


def auto_checkpoint(
    model: nn.Module,
    memory_budget: int | str | None,
    *,
    example_batch: Any,
    step_fn: StepFn,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: str | list[str] | None = None,
    target_batch_size: int | Literal["max"] | None = None,
    policy: str = "optimal",
    every_k: int | None = None,
    cost_metric: Literal["flops", "ms", "time"] = "time",
    granularity: Literal["block", "op"] = "block",
    max_levels: int = 2,
    probe_batch_sizes: tuple[int, int] = (1, 2),
    check_batch_size: int | None = 4,
    guard_batchnorm: bool = True,
    batch_multiple: int = 1,
    optimizer_state_bytes: int | None = None,
    accumulate_grad_batches: int = 1,
    keep_hf_checkpointing: bool = False,
    allow_python_state: bool | list[str] = False,
    check_shapes: bool = True,
    verbose: bool = True,
    info: Callable[[str], None] = print,
) -> CheckpointHandle:
    """Profile `step_fn` on slices of `example_batch`, plan within `memory_budget` and apply the plan.

    Args:
        model: the module whose blocks are checkpointed; a Fabric module (after `fabric.setup`), DDP or
            compiled wrapper is seen through, and block paths are those of your own module.
        memory_budget: per-device peak allowed for the whole step, bytes or e.g. ``"6GiB"``; None: 90%
            of the CUDA memory free now (on CPU it must be given).
        example_batch: a batch as your loader gives it; profiling runs on slices of it.
        step_fn: ``step_fn(batch) -> loss``: the forward of one training step (not its backward).
        optimizer: the optimizer your loop steps; its state is counted before it exists (Adam, AdamW,
            SGD, RMSprop, Adagrad; others need `optimizer_state_bytes`). None: no optimizer state.
        target_batch_size: None: the example batch's size; an int: plan for that size from the
            example's profile; ``"max"``: the largest batch (a multiple of `batch_multiple`) that fits,
            then `handle.batch_size`.
        accumulate_grad_batches: > 1 when gradients of earlier micro-batches are alive in the step.
        keep_hf_checkpointing: leave the model's own (HF) gradient checkpointing in charge (no plan applied).
        allow_python_state: let blocks whose forward writes Python state (a counter, a list, `random`
            draws) be checkpointed: True, or their names. By default they stay kept.
        check_shapes: refuse a training forward larger than any planned one that `handle.step` did not plan.
        info: where messages go (rank 0 only).
        The other arguments are `ActivationCheckpointing`'s.
    """
    budget_bytes = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={model!r} has type {type(model).__name__}, not torch.nn.Module; pass the module you train.")
    arguments.check_target(example_batch_size(example_batch) if target_batch_size is None else target_batch_size,
                           batch_multiple)
    arguments.check_policy(policy, every_k, cost_metric, granularity, max_levels)
    blocks = arguments.check_blocks(blocks)
    probes = arguments.check_probes(probe_batch_sizes, check_batch_size)
    arguments.positive_int(accumulate_grad_batches, "accumulate_grad_batches", "1 when every step steps the optimizer.")
    if not callable(step_fn):
        raise TypeError(f"step_fn={step_fn!r} is not callable; pass a function batch -> loss (the step's forward).")
    if not callable(info):
        raise TypeError(f"info={info!r} is not callable; pass a function that takes a message, such as print.")
    arguments.check_flags(guard_batchnorm=guard_batchnorm, keep_hf_checkpointing=keep_hf_checkpointing,
                          check_shapes=check_shapes, verbose=verbose)
    if optimizer_state_bytes is not None and (isinstance(optimizer_state_bytes, bool) or
                                              not isinstance(optimizer_state_bytes, int) or optimizer_state_bytes < 0):
        raise ValueError(f"optimizer_state_bytes={optimizer_state_bytes!r} must be a whole number of bytes, 0 or more "
                         "(the optimizer's state once it exists), or None to have it sized from the optimizer.")
    driver = PlainDriver(model, step_fn, optimizer, optimizer_state_bytes, accumulate_grad_batches > 1, info=info)
    driver.observe_grads()  # the first plan counts the gradients the loop holds now (none before its first step)
    _check_optimizer(driver.optimizer, optimizer_state_bytes)
    budget = arguments.resolve_budget(budget_bytes, _device_of(driver.model))
    settings = EngineSettings(
        budget, policy, every_k, cost_metric, granularity, max_levels, probes, check_batch_size, guard_batchnorm,
        batch_multiple, keep_hf_checkpointing,
        allow_python_state=arguments.check_allow_python_state(allow_python_state),
    )

    told: set[str] = set()  # what was said of the model, once for all the engines of its candidate chains

    def bound(modules: list[nn.Module], names: list[str]) -> CheckpointEngine:
        _refuse_compiled(model, driver.model, modules)
        engine = CheckpointEngine(settings, driver, told)
        engine.bind(modules, names, model=driver.model)  # HF caches off until `remove` (`model_compat`)
        return engine

    if blocks is None:  # the chain, at the level of the module tree, that plans least recompute
        with preserved_rng():
            choice = discover_chain(
                driver.model, step_fn, example_batch, room=reading_room(driver, budget, driver.model, example_batch)
            )
        driver.info(f"lightning-ckpt: {choice}")
        size = example_batch_size(example_batch) if target_batch_size in (None, "max") else int(target_batch_size)
        engine, chosen = engine_for_chain(
            choice, lambda c: bound(list(c.modules), list(c.names)),
            lambda e: e.plan_max(example_batch) if target_batch_size == "max" else e.preview(example_batch, size),
            size, target_batch_size == "max", driver.info, skips_coarser(policy, granularity),
        )
        engine.bind(list(chosen.modules), list(chosen.names), model=driver.model)  # bound again: its profile kept
    else:
        _, names, modules = resolve_blocks(driver.model, blocks)
        engine = bound(modules, names)
    try:
        _plan_first(engine, example_batch, target_batch_size)
    except BaseException:
        engine.close()  # nothing of it is left on the model
        raise
    if verbose:
        driver.info(plan_summary(engine.plan))
    return CheckpointHandle(engine, driver, check_shapes, verbose)


def _plan_first(engine: CheckpointEngine, example_batch: Any, target_batch_size: int | str | None) -> None:
    shape = shape_of(example_batch)
    if target_batch_size == "max":
        best = engine.plan_max(example_batch).batch_size
        engine.step_shape(shape.with_batch_size(best))
    elif target_batch_size is None or target_batch_size == shape.batch_size:
        engine.step(example_batch)
    else:
        engine.prime(example_batch)
        engine.step_shape(shape.with_batch_size(int(target_batch_size)))


def example_batch_size(batch: Any) -> int:
    from lightning_ckpt.profiling.structure.batch import batch_size_of

    return batch_size_of(batch)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _refuse_compiled(model: nn.Module, module: nn.Module, blocks: list[nn.Module]) -> None:
    from lightning_ckpt.apply.compiled import compiled_modules

    found = compiled_modules(module, blocks) + (["the model"] if model is not module and hasattr(model, "_orig_mod") else [])
    if found:
        raise ValueError(
            f"auto_checkpoint got a compiled model ({', '.join(found)}); in a plain loop it plans and applies eager "
            "blocks only. Call auto_checkpoint on the uncompiled model and train it eagerly, or train with the "
            "Lightning callback, which plans and applies checkpoint regions inside compiled graphs."
        )


def _check_optimizer(optimizer: torch.optim.Optimizer | None, state_bytes: int | None) -> None:
    """An optimizer whose state cannot be sized before it exists is refused, unless its size is given."""
    if optimizer is None or state_bytes is not None or optimizer.state:
        return
    if not isinstance(optimizer, KNOWN_OPTIMIZERS):
        known = ", ".join(k.__name__ for k in KNOWN_OPTIMIZERS)
        raise ValueError(
            f"optimizer={type(optimizer).__name__} has no state yet and lightning-ckpt cannot tell how much it will "
            f"keep (it sizes {known} before their first step). Pass optimizer_state_bytes= its state's size in "
            "bytes, or run one optimizer step before auto_checkpoint so that its state exists and is measured."
        )
