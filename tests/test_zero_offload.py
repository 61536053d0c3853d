"""ZeRO-Offload composed with the plan, on one CPU rank: DeepSpeedCPUAdam, bf16-mixed, an MLP stack whose
optimizer state is most of its memory.

The slow tests share one job: `python tests/test_zero_offload.py OUT_DIR`, started as a rank of its own
(`rank_jobs.launch_ranks`), which JIT-builds DeepSpeed's CPU Adam the first time (about two minutes here),
then fits each configuration with and without the callback and writes what it saw to OUT_DIR/rank0.json.

On a CPU-only machine the device is the CPU too, so the measure here counts what DeepSpeed keeps as the
device's: a dispatch mode written below counts every storage alive in the step, less the host tensors
named off DeepSpeed's optimizer object (fp32 partitions and their gradients, moments, copy buffers, under
`offload_param` the parameter partitions); under `offload_param` a parameter ZeRO-3 has gathered
(`ds_status` AVAILABLE) counts as its device copy, which DeepSpeed makes on an accelerator but not on the
CPU (there it aliases the host partition). Run alone: `OMP_NUM_THREADS=1 pytest tests/test_zero_offload.py -m slow`.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 480  # about 2 minutes of CPU Adam build and 1.5 of fits here; a hang is killed at this point
N_BLOCKS, D_MODEL, SEQ, BATCH, STEPS = 6, 128, 64, 8, 4
MEASURED_STEP = 2  # a steady step: optimizer state exists, the plan applied
BUCKET = 2**18  # DeepSpeed's reduce bucket (elements); its 5e8 default would be 1 GB of bf16 buckets
# Budgets between the `full` plan's peak and no checkpointing's (5.7 / 11.5 MB at ZeRO-2, 3.5 / 9.4 MB at
# ZeRO-3 with offload_param), far below the 12-15 MB the model's state takes when counted on the device.
BUDGETS = {"zero2": 8_000_000, "zero3": 6_500_000}
HOST_BUDGET = "4MiB"  # below the 13.8 MiB ZeRO-2 keeps in host memory here


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    from rank_jobs import launch_ranks

    out = tmp_path_factory.mktemp("zero_offload")
    return launch_ranks(1, [__file__, str(out)], out, JOB_TIMEOUT_S)[0]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("run", sorted(BUDGETS))
def test_plans_and_trains_at_a_budget_only_offloading_meets(job, run):
    """ZeRO-2 with offload_optimizer, ZeRO-3 with offload_param and offload_optimizer: the budget is below
    the model's state as if it stayed on the device, yet the fit plans and trains, within the budget by the
    callback's own measure, with losses equal bit for bit to the fit without the callback."""
    found = job[run]
    assert found["budget"] < found["static_on_device"], found  # refused if the offloaded state were counted
    assert found["segments"] and found["fits"], found
    assert len(found["losses_ckpt"]) == len(found["losses_plain"]) == STEPS
    assert found["losses_ckpt"] == found["losses_plain"], found
    assert found["callback_measured"] <= found["budget"], found  # host tensors are not the device's


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("run", sorted(BUDGETS))
def test_predicted_device_peak_within_3_percent(job, run):
    """The plan's predicted peak against the device-resident peak of a steady step (module docstring)."""
    found = job[run]
    assert abs(found["predicted"] - found["measured"]) <= 0.03 * found["measured"], found


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("run", sorted(BUDGETS))
def test_host_bytes_are_deepspeeds_host_tensors(job, run):
    """What the plan says lives in host memory against the host tensors DeepSpeed holds after a step."""
    found = job[run]
    assert abs(found["plan_host_bytes"] - found["host_held"]) <= 0.01 * found["host_held"], found
    assert found["plan_host_bytes"] > found["predicted"]  # the optimizer state dominates, as intended


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_host_budget_too_small_is_refused_naming_both_numbers(job):
    error = job["host_refused"]
    assert error.startswith("InfeasibleBudgetError"), error
    assert "the strategy keeps 13.8 MiB per rank in host memory" in error, error
    assert "over the host budget of 4.0 MiB" in error, error
    assert "optimizer state 6.1 MiB" in error, error


# ---------------------------------------------------------------------------- the rank's side


def host_tensors(engine, module) -> list:  # pragma: no cover - runs in the job
    """The tensors DeepSpeed keeps in host memory under offloading, read off its optimizer object."""
    import torch

    found: list = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    opt = engine.optimizer
    for name in ("single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
                 "temp_grad_buffer_for_cpu_offload", "accumulated_grads_in_cpu", "fp32_partitioned_groups_flat",
                 "grad_partitions_flat_buffer", "param_groups_fp16_flat_cpu_memory"):
        walk(getattr(opt, name, None))
    found += [t.grad for t in found if t.grad is not None]
    walk([dict(s) for s in opt.optimizer.state.values()])
    if getattr(opt, "offload_param", False):
        found += [p.ds_tensor for p in module.parameters() if getattr(p, "ds_tensor", None) is not None]
    return found


def device_tensors(engine, module) -> list:  # pragma: no cover - runs in the job
    """What exists on the device before a step: parameters (their flat buffers), buffers, gradients,
    DeepSpeed's one-parameter gradient buffer and the stage-3 buckets."""
    found = list(module.parameters()) + list(module.buffers()) + [p.grad for p in module.parameters() if p.grad is not None]
    found += [p.ds_tensor for p in module.parameters() if getattr(p, "ds_tensor", None) is not None]
    opt = engine.optimizer
    for name in ("temp_grad_buffer_for_gpu_offload",):
        if getattr(opt, name, None) is not None:
            found.append(getattr(opt, name))
    found += list(getattr(opt, "bit16_groups_flat", []))
    found += [b.buffer for b in getattr(opt, "ipg_buckets", {}).values() if hasattr(b, "buffer") and hasattr(b.buffer, "untyped_storage")]
    return found


def _key(t):  # pragma: no cover - runs in the job
    st = t.untyped_storage()
    return None if st.nbytes() == 0 else st.data_ptr()


def device_peak_mode(excluded: set, gathered: list):  # pragma: no cover - runs in the job
    """A dispatch mode counting each storage alive once (weak-reference finalizers), storages in `excluded`
    never, plus the ZeRO-3 parameters in `gathered` while DeepSpeed has them gathered."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from torch.utils._python_dispatch import TorchDispatchMode

    class DevicePeak(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.sizes, self.peak, self.refs = 0, {}, 0, []

        def count(self, t):
            import torch

            if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
                return
            key = _key(t)
            if key is None or key in excluded or key in self.sizes:
                return
            st = t.untyped_storage()
            self.sizes[key] = st.nbytes()
            self.live += st.nbytes()
            self.refs.append(weakref.ref(st, lambda _r, key=key: self.drop(key)))

        def drop(self, key):
            self.live -= self.sizes.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                self.count(t)
            on = sum(p.ds_numel * p.element_size() for p in gathered if p.ds_status == ZeroParamStatus.AVAILABLE)
            self.peak = max(self.peak, self.live + on)
            return out

    return DevicePeak()


def _model():  # pragma: no cover - runs in the job
    from lit_models import LitChain

    class OffloadChain(LitChain):
        def configure_optimizers(self):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(self.parameters(), lr=1e-3)

    return OffloadChain(n_blocks=N_BLOCKS, d=D_MODEL, lr=1e-3)


def _strategy(run: str):  # pragma: no cover - runs in the job
    from lightning_ckpt import DeepSpeedStrategy

    if run == "zero2":
        return DeepSpeedStrategy(stage=2, offload_optimizer=True, reduce_bucket_size=BUCKET,
                                 allgather_bucket_size=BUCKET, logging_level=40)
    strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True, reduce_bucket_size=BUCKET,
                                 allgather_bucket_size=BUCKET, param_persistence_threshold=0, logging_level=40)
    # no prefetching, no parameter kept for reuse: ZeRO-3 gathers one module's parameters at a time
    strategy.config["zero_optimization"].update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    return strategy


def _probe():  # pragma: no cover - runs in the job
    import lightning.pytorch as pl

    class Probe(pl.Callback):
        """The device-resident peak of one steady step, and the host tensors DeepSpeed holds then."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx != MEASURED_STEP:
                return
            from lightning_ckpt.profiling.memory.tracker import unique_storage_bytes

            engine = trainer.strategy.model
            host = host_tensors(engine, pl_module)
            self.host_held = unique_storage_bytes(host)
            excluded = {k for k in map(_key, host) if k is not None}
            offload_param = getattr(engine.optimizer, "offload_param", False)
            gathered = [p for p in pl_module.parameters() if offload_param and not p.ds_persist]
            self.mode = device_peak_mode(excluded, gathered)
            self.mode.__enter__()
            for t in device_tensors(engine, pl_module) + list(batch):
                self.mode.count(t)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == MEASURED_STEP:
                self.mode.__exit__(None, None, None)
                self.measured = self.mode.peak

    return Probe()


def _fit(run: str, callbacks: list):  # pragma: no cover - runs in the job
    import lightning.pytorch as pl
    from lit_models import TokenData

    pl.seed_everything(0, verbose=False)
    model = _model()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=_strategy(run), precision="bf16-mixed", max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(model, datamodule=TokenData(batch_size=BATCH, n=64, seq=SEQ))
    return trainer, model


def _callback(budget, **kw):  # pragma: no cover - runs in the job
    from lightning_ckpt import ActivationCheckpointing

    return ActivationCheckpointing(target_batch_size=BATCH, memory_budget=budget, blocks="net.blocks", verbose=True,
                                   report=False, **kw)


def _run(run: str) -> dict:  # pragma: no cover - runs in the job
    from lightning_ckpt.profiling.memory.zero_memory import zero_memory

    _, plain = _fit(run, [])
    cb, probe = _callback(BUDGETS[run]), _probe()
    trainer, model = _fit(run, [cb, probe])
    zm = trainer.strategy.zero_memory(model)
    fields = {k: getattr(zm, k) for k in ("stage", "world_size", "precision", "buffer_bytes")}
    on_device = zero_memory([(p.ds_numel if hasattr(p, "ds_numel") else p.numel(), True) for p in model.parameters()],
                            reduce_bucket_size=BUCKET, persistence_threshold=0, overlap_comm=True, **fields)
    return {
        "budget": BUDGETS[run],
        "static_on_device": on_device.to_static_memory().resident_bytes,
        "segments": [list(s) for s in cb.plan.segments],
        "fits": cb.plan.fits,
        "predicted": cb.plan.predicted_peak_bytes,
        "measured": probe.measured,
        "callback_measured": cb.measured_peak_bytes,
        "plan_host_bytes": cb.plan.host_bytes,
        "host_held": probe.host_held,
        "losses_plain": [float(x) for x in plain.losses],
        "losses_ckpt": [float(x) for x in model.losses],
    }


def _host_refused() -> str:  # pragma: no cover - runs in the job
    try:
        _fit("zero2", [_callback(BUDGETS["zero2"], host_memory_budget=HOST_BUDGET)])
    except Exception as err:  # noqa: BLE001 - the refusal is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


def _worker(out_dir: Path) -> None:  # pragma: no cover - runs in the job
    import faulthandler

    faulthandler.dump_traceback_later(JOB_TIMEOUT_S - 20, exit=True)  # stacks in the log if anything hangs
    import torch

    torch.set_num_threads(1)
    results = {run: _run(run) for run in sorted(BUDGETS)}
    results["host_refused"] = _host_refused()
    (out_dir / "rank0.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":  # pragma: no cover - the job
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    _worker(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
