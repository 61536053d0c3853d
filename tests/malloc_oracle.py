"""A measure of a training step's peak memory that shares nothing with the library's accounting:
glibc's own count of heap bytes in use (`mallinfo2`), sampled before and after every op by a
dispatch mode written here. Run as a script, it plans one model with the library, trains it a few
steps with the plan applied and prints what it measured as one JSON line; `test_memory_oracle.py`
runs it in a fresh process and states the formula and the tolerance.

    OMP_NUM_THREADS=1 python tests/malloc_oracle.py cnn [--tracker]
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the measurement


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc 2.33 and later): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _load_mallinfo2() -> Callable[[], _MallInfo2]:
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError) as err:
        raise RuntimeError(
            f"the malloc oracle reads glibc's mallinfo2 (glibc 2.33 or later), which this C library lacks ({err}); "
            "run it on a glibc Linux"
        ) from err
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_mallinfo2 = _load_mallinfo2()


def heap_in_use_bytes() -> int:
    """Bytes malloc has handed out and not taken back: chunks in use in every arena (`uordblks`, with
    their headers) plus chunks malloc mapped on their own (`hblkhd`, whole pages). Freed chunks that
    wait in an arena are not counted, so heap fragmentation does not show here (it does in RSS)."""
    info = _mallinfo2()
    return info.uordblks + info.hblkhd


def settled_heap_bytes() -> int:
    """`heap_in_use_bytes` once Python's garbage is collected and glibc has consolidated its free chunks and
    handed free pages back (`malloc_trim(0)`): two moments with the same objects alive read alike (within
    tens of KiB, measured: `test_profile_budget`)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return heap_in_use_bytes()


def _returns_only_aliases(func) -> bool:
    """Whether every result of the op is (a view of) one of its inputs, by its schema: views,
    in-place and `out=` ops. Such an op makes no new storage."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None for r in returns)


class MallocPeak(TorchDispatchMode):
    """The most heap bytes in use seen while active: sampled on entry, after every op that returns
    a new result (its outputs exist then; views and in-place ops make no storage and are skipped)
    and on exit. Every tensor storage is allocated inside an op, so each rise that tensors make is
    seen. Not seen: scratch an op allocates and frees inside itself, and anything allocated and freed
    again between two samples (the Python and autograd bookkeeping in between comes a few hundred
    bytes at a time, and what of it stays is in the next sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak_bytes = 0
        self.ops = 0
        self._skip: dict[Any, bool] = {}

    def __enter__(self) -> "MallocPeak":
        self.peak_bytes = heap_in_use_bytes()
        self.ops = 0
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.peak_bytes = max(self.peak_bytes, heap_in_use_bytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        skip = self._skip.get(func)
        if skip is None:
            skip = self._skip[func] = _returns_only_aliases(func)
        if not skip:
            now = heap_in_use_bytes()
            if now > self.peak_bytes:
                self.peak_bytes = now
        return out


# ----------------------------------------------------------------------------- the models


@dataclass
class Case:
    """One model to check: its chain (as `resolve_blocks` takes it), one batch, the loss of a batch
    and the optimizer a user would train it with."""

    model: torch.nn.Module
    chain: Any
    batch: Any
    batch_size: int
    loss: Callable[[Any], torch.Tensor]
    optimizer: Callable[[], torch.optim.Optimizer]


def _adamw(model: torch.nn.Module) -> Callable[[], torch.optim.Optimizer]:
    return lambda: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _classifier_case(model: torch.nn.Module, data: Any, chain: Any, batch_size: int, optimizer=None) -> Case:
    """An example's classifier trained with cross entropy on the first batch of its data module."""
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))

    def loss(b):
        return torch.nn.functional.cross_entropy(model(b[0]), b[1])

    return Case(model, chain, batch, batch_size, loss, optimizer or _adamw(model))


def encoder() -> Case:
    """The example's 48-block encoder (d_model 128, sequence 128) at batch 4."""
    from train_encoder import EncoderClassifier, SyntheticTextDataModule

    return _classifier_case(EncoderClassifier(), SyntheticTextDataModule(batch_size=4, n_train=4, n_val=4), "blocks", 4)


def cnn() -> Case:
    """The CNN example (9 blocks, BatchNorm) at batch 32 with its own optimizer."""
    from examples.train_cnn import ShapesDataModule, ShapesResNet

    model = ShapesResNet()
    chain = ["stem", "layer1.*", "layer2.*", "layer3.*", "layer4.*"]
    return _classifier_case(model, ShapesDataModule(batch_size=32, n_train=32, n_val=32), chain, 32, model.configure_optimizers)


def _zoo(entry, batch_size: int) -> Case:
    chain = entry.chain if isinstance(entry.chain, str) else list(entry.chain)
    return Case(entry.model, chain, entry.batch(batch_size, seed=0), batch_size, entry.loss, _adamw(entry.model))


def bert() -> Case:
    """HF `BertForSequenceClassification` from the zoo, 8 layers of width 128, sequence 128, batch 8."""
    import zoo_models

    return _zoo(zoo_models.bert(layers=8, hidden=128, seq=128), 8)


def unet() -> Case:
    """diffusers `UNet2DModel` from the zoo (32 x 32 samples, channels 32 and 64), batch 8."""
    import zoo_models

    return _zoo(zoo_models.unet(sample=32, channels=(32, 64)), 8)


CASES: dict[str, Callable[[], Case]] = {"encoder": encoder, "cnn": cnn, "bert": bert, "unet": unet}


# ----------------------------------------------------------------------------- one run


def _step(case: Case, opt: torch.optim.Optimizer) -> None:
    """One step in Lightning's order: forward and loss, `zero_grad`, backward, optimizer step."""
    loss = case.loss(case.batch)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _build(name: str) -> Case:
    torch.manual_seed(0)
    case = CASES[name]()
    case.model.train()
    return case


def _plan(name: str, share: float) -> tuple[Any, dict]:
    """Plan on a twin of the model (the same seed; profiled with `profile_model`'s defaults) and run
    one planned step on it, so that whatever torch, the model's libraries and the library set up on
    first use exists before the baseline."""
    from lightning_ckpt import apply_plan, make_plan, profile_model, resolve_blocks, static_memory
    from lightning_ckpt.engine.model_prep import prepare_model
    from lightning_ckpt.engine.target_plan import cost_at

    twin = _build(name)
    with prepare_model(twin.model, warn=lambda message: None):
        opt = twin.optimizer()
        _step(twin, opt)  # gradients and optimizer state exist, as in steady training
        _, names, blocks = resolve_blocks(twin.model, twin.chain)
        profile = profile_model(twin.model, blocks, twin.loss, twin.batch, names=names, timing=False)
        cost = cost_at(profile, twin.batch_size, static_memory(twin.model, [opt]))
        none, full = (make_plan(cost, p).predicted_peak_bytes for p in ("none", "full"))
        budget = int(full + share * (none - full))
        plan = make_plan(cost, "optimal", budget, metric="flops")
        handle = apply_plan(blocks, plan)
        _step(twin, opt)
        handle.remove()
    facts = {
        "none_bytes": none, "full_bytes": full, "budget_bytes": budget, "predicted_bytes": plan.predicted_peak_bytes,
        "n_blocks": plan.n_blocks, "checkpointed": len(plan.checkpointed), "segments": [list(s) for s in plan.segments],
    }
    return plan, facts


def _measure(case: Case, opt: torch.optim.Optimizer, base: int, steps: int) -> tuple[list[int], list[int], int]:
    """(peak - base, start - base) of each of `steps` steps, and the ops one step ran."""
    peaks, starts, ops = [], [], 0
    for _ in range(steps):
        gc.collect()
        starts.append(heap_in_use_bytes() - base)
        with MallocPeak() as probe:
            _step(case, opt)
        peaks.append(probe.peak_bytes - base)
        ops = probe.ops
    return peaks, starts, ops


def run(name: str, share: float = 0.5, steps: int = 2, tracker: bool = False, apply: bool = True) -> dict:
    """Plan `name` at the budget `share` of the way from `full` to `none`, then measure a fresh copy
    trained with the plan (and, after it, without): heap bytes above the baseline taken before the
    measured model existed. `tracker` adds the library's own measure for comparison; `apply=False`
    leaves the plan out of the planned steps (to see the check fail)."""
    from lightning_ckpt import apply_plan, resolve_blocks
    from lightning_ckpt.engine.model_prep import prepare_model

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    plan, out = _plan(name, share)
    gc.collect()
    base = heap_in_use_bytes()  # [baseline] nothing of the measured model, its optimizer or its batch exists yet

    case = _build(name)
    prepared = prepare_model(case.model, warn=lambda message: None)
    opt = case.optimizer()
    _, _, blocks = resolve_blocks(case.model, case.chain)
    handle = apply_plan(blocks, plan) if apply else None
    _step(case, opt)  # the first step creates gradients and optimizer state; the measured ones start from them
    out["planned_peak_bytes"], out["planned_start_bytes"], out["ops_per_step"] = _measure(case, opt, base, steps)
    if handle is not None:
        handle.remove()
    out["unplanned_peak_bytes"], _, _ = _measure(case, opt, base, 1)
    if tracker:
        from lightning_ckpt import measure_step_peak, static_memory

        static = static_memory(case.model, [opt])
        out["library_static_bytes"] = static.resident_bytes + static.grad_bytes
        handle = apply_plan(blocks, plan)
        out["library_tracker_bytes"] = measure_step_peak(case.model, case.loss, case.batch, opt)
        handle.remove()
    prepared.restore()
    out["name"], out["share"], out["batch_size"] = name, share, case.batch_size
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv: list[str]) -> None:
    for path in (ROOT, ROOT / "examples", ROOT / "tests"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    name = argv[0]
    print(json.dumps(run(name, tracker="--tracker" in argv, apply="--no-apply" not in argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
