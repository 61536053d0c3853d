"""`DeepSpeedStrategy` and the callback on two CPU ranks (gloo): ZeRO 1-3, bf16, DDP.

The slow tests share one two-rank job: `python tests/test_strategy.py OUT_DIR` started
twice with LOCAL_RANK 0 and 1 (Lightning then launches nothing itself). Each rank runs
every configuration in turn (one process group, DeepSpeed's shared-memory op built
once) and writes what it saw to OUT_DIR/rank<r>.json; the tests compare the two files.
Run alone: `OMP_NUM_THREADS=1 pytest tests/test_strategy.py -m slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rank_jobs import DIST_ENV, EXTENSIONS_DIR, launch_ranks

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 420  # the whole two-rank job takes about 1.5 minutes here; a hang is killed at this point
STAGES = (1, 2, 3)
PRECISIONS = ("32-true", "bf16-mixed")
N_BLOCKS, D_MODEL, SEQ, BATCH, STEPS = 5, 32, 64, 8, 5
BUCKET = 2**20  # DeepSpeed's reduce bucket (elements); its 5e8 default would be 2 GB of buckets here


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("two_ranks")
    return launch_ranks(2, [__file__, str(out)], out, JOB_TIMEOUT_S)


# ---------------------------------------------------------------------------- in-process


def test_bad_persistence_threshold():
    from lightning_ckpt import DeepSpeedStrategy

    with pytest.raises(ValueError, match=r"param_persistence_threshold=-1 must be a non-negative integer"):
        DeepSpeedStrategy(stage=3, param_persistence_threshold=-1)
    with pytest.raises(ValueError, match=r"applies to ZeRO stage 3, but the DeepSpeed config has no zero_optimization"):
        DeepSpeedStrategy(zero_optimization=False, param_persistence_threshold=0)
    strategy = DeepSpeedStrategy(stage=3, param_persistence_threshold=0)
    assert strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert strategy.zero_stage == 3


def test_cpu_needs_deepspeeds_cpu_accelerator(monkeypatch):
    import deepspeed
    from lightning.pytorch.accelerators import CPUAccelerator

    from lightning_ckpt import DeepSpeedStrategy

    class Cuda:
        def device_name(self, *args):
            return "cuda"

    strategy = DeepSpeedStrategy(stage=2, accelerator=CPUAccelerator())
    monkeypatch.setattr(deepspeed, "get_accelerator", lambda: Cuda())
    with pytest.raises(RuntimeError, match=r"picked its 'cuda' accelerator.*DS_ACCELERATOR=cpu"):
        strategy.setup_environment()


def test_off_cpu_it_is_lightnings_strategy(monkeypatch):
    """Any accelerator but CPU takes Lightning's own code paths, unchanged."""
    import argparse

    import deepspeed
    from lightning.pytorch.accelerators import CUDAAccelerator

    from lightning_ckpt import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=2, accelerator=CUDAAccelerator())
    seen = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: seen.append(kw["args"].device_rank))
    with strategy._cpu_device_rank():
        deepspeed.initialize(args=argparse.Namespace(device_rank=None))
    assert seen == [None]  # not rewritten off CPU
    with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
        DeepSpeedStrategy(stage=2, accelerator=_OtherAccelerator()).setup_environment()


class _OtherAccelerator:
    """Stands for any accelerator that is neither CPU nor CUDA."""


def test_cpu_passes_local_rank_as_device_rank(monkeypatch):
    import argparse

    import deepspeed
    from lightning.pytorch.accelerators import CPUAccelerator

    from lightning_ckpt import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=2, accelerator=CPUAccelerator())
    seen = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: seen.append(kw["args"].device_rank))
    with strategy._cpu_device_rank():
        deepspeed.initialize(args=argparse.Namespace(device_rank=None))
    deepspeed.initialize(args=argparse.Namespace(device_rank=None))
    assert seen == [0, None]  # the local rank inside, restored after


def test_strategy_static_memory_is_the_zero_model():
    from models import TinyChain

    from lightning_ckpt import DeepSpeedStrategy, zero_memory

    net = TinyChain(n_blocks=3, d=16)
    strategy = DeepSpeedStrategy(stage=3, param_persistence_threshold=0, reduce_bucket_size=1000)
    expected = zero_memory(
        [(p.numel(), True) for p in net.parameters()], stage=3, world_size=1, precision="32-true",
        persistence_threshold=0, reduce_bucket_size=1000, overlap_comm=True,
    )
    assert strategy.zero_memory(net) == expected
    assert strategy.ckpt_static_memory(net, []) == expected.to_static_memory()
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    strategy.precision_plugin = DeepSpeedPrecision("16-mixed")
    with pytest.raises(ValueError, match=r"precision 32-true, bf16-mixed, bf16-true, not '16-mixed'"):
        strategy.ckpt_static_memory(net, [])


def test_profiling_context_pauses_gradient_hooks():
    import torch
    from models import TinyChain

    from lightning_ckpt import DeepSpeedStrategy

    net = TinyChain(n_blocks=2, d=8)
    fired = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    strategy = DeepSpeedStrategy(stage=2)
    strategy._lightning_module = net
    x = torch.randint(0, 50, (2, 5))
    with strategy.ckpt_profiling_context():
        net(x).sum().backward()
    assert fired == []
    net(x).sum().backward()
    assert len(fired) == len(list(net.parameters()))


def test_bf16_autocast_activation_peak_within_10_percent():
    """Plain Lightning bf16-mixed (autocast): the profile runs under the run's
    autocast, where layer norms, softmax and the loss stay fp32; the predicted peak of
    forward + backward is within 10 % of the measured one, and it is not half of fp32's."""
    import torch
    from lit_models import LitChain, TokenData, make_trainer

    from lightning_ckpt import ActivationCheckpointing

    found = {}
    for precision in ("32-true", "bf16-mixed"):
        torch.manual_seed(0)
        cb = ActivationCheckpointing(target_batch_size=16, memory_budget="1GiB", policy="every_k", every_k=2,
                                     verbose=False, report=False)
        probe = _activation_probe(cb)
        make_trainer([cb, probe], max_steps=2, precision=precision).fit(
            LitChain(n_blocks=N_BLOCKS, d=D_MODEL, lr=1e-3), datamodule=TokenData(batch_size=16, n=64, seq=SEQ))
        found[precision] = (probe.predicted, probe.measured)
    predicted, measured = found["bf16-mixed"]
    assert abs(predicted - measured) <= 0.10 * measured, found
    assert not 0.45 < measured / found["32-true"][1] < 0.55, found


# ---------------------------------------------------------------------------- two CPU ranks


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero_losses_equal_without_checkpointing(ranks, stage, precision):
    """ZeRO 1-3 x fp32/bf16-mixed, 2 ranks, 5 steps: the callback's plan gives the
    losses of the run without checkpointing, bit for bit. bf16 is bit-identical too: DeepSpeed
    runs the bf16-cast model, and a recompute repeats the same bf16 ops on the same inputs."""
    for r in ranks:
        run = r["zero"][f"{stage}/{precision}"]
        assert run["segments"], "the plan checkpoints nothing"
        assert len(run["losses_ckpt"]) == len(run["losses_plain"]) == STEPS
        assert run["losses_ckpt"] == run["losses_plain"], (r["rank"], run)
    # the ranks saw different data, so the equality above is per rank, not a copy
    assert ranks[0]["zero"][f"{stage}/{precision}"]["losses_plain"] != ranks[1]["zero"][f"{stage}/{precision}"]["losses_plain"]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero_static_bytes_within_5_percent(ranks, stage, precision):
    """The ZeRO model's per-rank bytes against the parameter, gradient and
    optimizer tensors DeepSpeed holds after a step (unique storages, counted on each rank).
    With the callback DeepSpeed holds exactly as much: profiling left nothing behind."""
    for r in ranks:
        run = r["zero"][f"{stage}/{precision}"]
        assert abs(run["predicted_held"] - run["held"]) <= 0.05 * run["held"], (r["rank"], run["held"], run["predicted_held"])
        assert run["held_ckpt"] == run["held"]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero3_blocks_chain_into_multi_block_segments(ranks, precision):
    """ZeRO-3 re-wraps every module's inputs and outputs in identity autograd Functions, so a
    block receives an alias of the previous block's output, not the object: the profile still
    sees the blocks chain, every_k=2 keeps its two-block segments, and the recompute of a
    segment (blocks called again, DeepSpeed's hooks firing again) trains bit for bit as the run
    without checkpointing."""
    for r in ranks:
        run = r["zero"][f"3/{precision}"]
        assert run["chains"] == [[True] * N_BLOCKS] * 2, (r["rank"], run["chains"])
        assert run["segments"] == [[0, 1], [2, 3], [4, 4]], (r["rank"], run["segments"])
        assert run["losses_ckpt"] == run["losses_plain"] and len(run["losses_ckpt"]) == STEPS, (r["rank"], run)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("key", ["0/32-true", "0/bf16-mixed", "3/bf16-true", "3/32-true/persistent", "3/bf16-mixed/frozen"])
def test_static_bytes_other_configurations(ranks, key):
    """Stage 0, bf16-true, ZeRO-3's default persistence of small parameters (all of this
    model's), and frozen parameters (partitioned, but no master weights or moments)."""
    for r in ranks:
        run = r["static"][key]
        assert abs(run["predicted_held"] - run["held"]) <= 0.05 * run["held"], (key, r["rank"], run)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("stage", (2, 3))
def test_bf16_activation_peak_within_10_percent(ranks, stage):
    """DeepSpeed under bf16-mixed: the profile is taken on the bf16 model
    DeepSpeed trains, so the predicted peak of forward + backward above the model state
    (activations, the gradients they produce and, at stage 3, the gathered parameters) is
    within 10 % of the tracker's measure. At stage 3 the gathered parameters are counted once,
    as the ZeRO model's `gather_bytes`: the profile does not see DeepSpeed gather them."""
    act = ranks[0]["zero"][f"{stage}/bf16-mixed"]["activation"]
    assert abs(act["predicted"] - act["measured"]) <= 0.10 * act["measured"], act
    # the profile saw the bf16 model: DeepSpeed casts all of it (no autocast), so each block
    # saves half the bytes it saves in fp32 (0.5 exactly here)
    bf16 = ranks[0]["zero"][f"{stage}/bf16-mixed"]["block_saved_bytes"]
    fp32 = ranks[0]["zero"][f"{stage}/32-true"]["block_saved_bytes"]
    assert 0.45 < bf16 / fp32 < 0.55, (bf16, fp32)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_plans_identical_across_ranks_under_timing_skew(ranks):
    """Rank 0 sees block times rising with depth, rank 1 falling; planning by
    measured time, each rank alone would pick other blocks. The broadcast plan is rank 0's
    on both ranks, and the job ended (no hang)."""
    a, b = ranks[0]["skew"], ranks[1]["skew"]
    assert a["applied"] == b["applied"] and a["plan"] == b["plan"]
    assert a["applied"] == a["local"], "rank 0 applies its own plan"
    assert b["local"] != b["applied"], "the skew must change what rank 1 alone would plan"
    assert a["fwd_ms"] != b["fwd_ms"]
    assert 0 < len(a["applied"]) and sum(q - p + 1 for p, q in a["applied"]) < N_BLOCKS


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_failure_on_one_rank_does_not_hang_the_others(ranks):
    """Profiling raises on rank 1 only: rank 1 applies rank 0's plan (with a warning). It raises
    on rank 0 only: every rank raises rank 0's error after the broadcast."""
    a, b = ranks[0]["failure"]["rank1"], ranks[1]["failure"]["rank1"]
    assert a["error"] is None and b["error"] is None
    assert a["segments"] == b["segments"] and a["segments"]
    assert b["warned"] and not a["warned"]
    for r in ranks:
        assert r["failure"]["rank0"]["error"] == "RuntimeError: injected failure on rank 0"


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_zero3_frozen_module_inside_checkpointed_segment(ranks):
    """ZeRO-3 (every parameter partitioned) with a frozen embedding, a frozen
    first block and a frozen LayerNorm inside the second, checkpointed together with it:
    trains without CheckpointError, losses equal to the plain run."""
    for r in ranks:
        run = r["frozen"]
        assert run["error"] is None, run["error"]
        # the frozen first block and the second (its LayerNorm frozen) share one segment: the
        # second receives an alias of the first's output (ZeRO-3 re-wraps it), which does not
        # require grad
        assert run["names"] == [f"net.blocks.{i}" for i in range(N_BLOCKS)], run["names"]
        assert run["segments"] == [[0, 1], [2, 3], [4, 4]], run["segments"]
        assert run["losses_ckpt"] == run["losses_plain"] and len(run["losses_ckpt"]) == STEPS


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_ddp_ranks_with_batches_of_different_lengths_run_the_plan_of_the_longest(ranks):
    """Each rank's batches are padded to their own longest sample, so the ranks' lengths differ; every
    rank applies the plan of the largest shape."""
    a, b = ranks[0]["ddp_shapes"], ranks[1]["ddp_shapes"]
    assert [r["length"] for r in a["rows"]] != [r["length"] for r in b["rows"]], "the lengths should differ"
    assert [r["segments"] for r in a["rows"]] == [r["segments"] for r in b["rows"]]
    assert [r["predicted"] for r in a["rows"]] == [r["predicted"] for r in b["rows"]]
    # the plan of every step is the one made for the longer of the two ranks' batches
    longest = [max(x["length"], y["length"]) for x, y in zip(a["rows"], b["rows"])]
    assert [r["planned_length"] for r in a["rows"]] == longest == [r["planned_length"] for r in b["rows"]]
    # each rank ran every step (no rank waited on the others); whether the measured steps fit is not
    # checked here: DDP's gradient buckets hold a copy of the gradients the memory model does not count yet
    assert len(a["peaks"]) == len(b["peaks"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_ddp_losses_equal_without_checkpointing(ranks, precision):
    """Lightning's plain DDP, 2 CPU ranks, fp32 and bf16-mixed (autocast): losses equal the plain run's and
    both ranks apply the same plan."""
    for r in ranks:
        run = r["ddp"][precision]
        assert run["segments"]
        assert run["losses_ckpt"] == run["losses_plain"] and len(run["losses_ckpt"]) == STEPS
    assert ranks[0]["ddp"][precision]["plan"] == ranks[1]["ddp"][precision]["plan"]


EXAMPLE_TIMEOUT_S = 400  # the shortened run takes about 1.5 minutes here


@pytest.mark.slow
@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
def test_zero3_example_config_runs(tmp_path):
    """README's ZeRO-3 command (shortened to 3 steps, no validation) trains on
    two CPU processes started by Lightning itself, with a plan applied on both."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=EXTENSIONS_DIR)
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_encoder.py"), "fit",
        "--config", str(ROOT / "configs" / "encoder48_zero3.yaml"),
        "--trainer.max_steps=3", "--trainer.limit_val_batches=0", f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: Lightning's rank 1 is in it
    try:
        out, _ = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"the ZeRO-3 example did not finish in {EXAMPLE_TIMEOUT_S} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert "lightning-ckpt plan: policy=optimal, batch_size=8" in out, out[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in out
    metrics = next(tmp_path.glob("encoder48_zero3/version_*/metrics.csv")).read_text()
    assert "ckpt/predicted_peak_bytes" in metrics


# ---------------------------------------------------------------------------- the ranks' side


def _worker(out_dir: Path) -> None:  # pragma: no cover - runs in the spawned ranks
    import faulthandler

    faulthandler.dump_traceback_later(JOB_TIMEOUT_S - 20, exit=True)  # stacks in the log if anything hangs
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["LOCAL_RANK"])
    results: dict = {"rank": rank, "zero": {}, "ddp": {}}
    for stage in STAGES:
        for precision in PRECISIONS:
            results["zero"][f"{stage}/{precision}"] = _zero_run(stage, precision, cb_first=stage == 1)
    results["static"] = {f"{stage}/{precision}": _static_only(stage, precision) for stage, precision in
                         ((0, "32-true"), (0, "bf16-mixed"), (3, "bf16-true"))}
    results["static"]["3/32-true/persistent"] = _static_only(3, "32-true", persistence=None)
    results["frozen"] = _frozen_run()
    results["static"]["3/bf16-mixed/frozen"] = {k: results["frozen"][k] for k in ("held", "predicted_held")}
    results["skew"] = _skew_run(rank)
    for precision in PRECISIONS:
        results["ddp"][precision] = _pair("ddp", precision)
    results["failure"] = _injected_failures(rank)
    results["ddp_shapes"] = _ddp_shapes_run()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


def _ds(stage: int, persistence: int | None = 0):
    from lightning_ckpt import DeepSpeedStrategy

    # threshold 0: every parameter is partitioned, so ZeRO-3 really gathers and releases
    return DeepSpeedStrategy(
        stage=stage, param_persistence_threshold=persistence if stage == 3 else None,
        reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET, logging_level=40,
    )


def _fit(strategy, precision, callbacks, model=None, seed=0):
    import lightning.pytorch as pl
    from lit_models import LitChain, TokenData

    pl.seed_everything(seed, verbose=False)
    model = model if model is not None else LitChain(n_blocks=N_BLOCKS, d=D_MODEL, lr=1e-3)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=TokenData(batch_size=BATCH, n=64, seq=SEQ))
    print(f"fit {strategy if isinstance(strategy, str) else type(strategy).__name__} {precision} "
          f"{[type(c).__name__ for c in callbacks]}: {time.perf_counter() - start:.1f} s", flush=True)
    return trainer, model


def _callback(**kw):
    from lightning_ckpt import ActivationCheckpointing

    kw.setdefault("policy", "every_k")
    if kw["policy"] == "every_k":
        kw.setdefault("every_k", 2)  # segments (0, 1), (2, 3), (4, 4): multi-block and single-block
    kw.setdefault("memory_budget", "1GiB")
    return ActivationCheckpointing(target_batch_size=BATCH, verbose=False, report=False, **kw)


def _held_callback():
    import lightning.pytorch as pl

    class Held(pl.Callback):
        """After the last optimizer step: bytes DeepSpeed holds, and what the model predicts."""

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == STEPS:
                self.held = held_bytes(trainer.strategy.model, pl_module)
                self.predicted = trainer.strategy.zero_memory(pl_module).held_bytes

    return Held()


def held_bytes(engine, module) -> int:
    """Unique storages of the module's parameters (their ZeRO-3 partitions included), their
    gradients, buffers, and every tensor reachable from DeepSpeed's optimizer object."""
    import torch

    from lightning_ckpt.profiling.memory.tracker import unique_storage_bytes

    found: list = []
    seen: set[int] = set()

    def walk(obj, depth=0):
        if depth > 8 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                walk(v, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v, depth + 1)

    walk(engine.optimizer)
    params = list(module.parameters())
    found += params + list(module.buffers())
    found += [p.grad for p in params if p.grad is not None] + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
    return unique_storage_bytes(found)


def _activation_probe(cb):
    """At the end of training (plan still applied): the peak of one forward + backward at the
    target batch above the model state, measured, and as the memory model predicts it. DeepSpeed's
    gradient hooks are paused as in a profile, but its parameter gathers stay in the measure (the
    profile leaves them to the ZeRO model's `gather_bytes`, which the prediction adds)."""
    import contextlib
    import dataclasses

    import lightning.pytorch as pl

    from lightning_ckpt.frontends.lightning.muted_logging import muted_logging
    from lightning_ckpt.planning.memory_model import predict_peak
    from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker

    class ActivationProbe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                self.batch = batch

        def on_train_end(self, trainer, pl_module):
            params = list(pl_module.parameters())
            pause = getattr(trainer.strategy, "_paused_gradient_hooks", contextlib.nullcontext)
            with pause():
                with LiveBytesTracker() as tracker:
                    with muted_logging(pl_module), trainer.precision_plugin.train_step_context():
                        loss = pl_module.training_step(self.batch, 0)
                    loss.backward()
                    del loss
                for p in params:
                    p.grad = None
            self.measured = tracker.peak_bytes
            if cb.cost is not None:  # rank 0 planned
                zero = getattr(trainer.strategy, "zero_memory", None)
                gathered = zero(pl_module).gather_bytes if zero is not None else 0
                bare = dataclasses.replace(cb.cost, static_bytes=gathered, optimizer_transient_bytes=0, grads_live_in_forward=False)
                self.predicted = predict_peak(bare, cb.plan.segments).peak_bytes

    return ActivationProbe()


def _losses(model) -> list[float]:
    return [float(x) for x in model.losses]


def _zero_run(stage: int, precision: str, cb_first: bool) -> dict:
    held = _held_callback()
    _, plain = _fit(_ds(stage), precision, [held])
    cb, held_ckpt = _callback(), _held_callback()
    probe = _activation_probe(cb) if precision == "bf16-mixed" and stage in (2, 3) else None
    callbacks = [cb, held_ckpt] if cb_first else [held_ckpt, cb]  # either order of the callbacks
    _, model = _fit(_ds(stage), precision, callbacks + ([probe] if probe else []))
    out = {
        "losses_plain": _losses(plain),
        "losses_ckpt": _losses(model),
        "segments": [list(s) for s in cb.plan.segments],
        "chains": [[b.chains_from_previous for b in p.blocks] for p in cb.profile.probes],
        "held": held.held,
        "held_ckpt": held_ckpt.held,
        "predicted_held": held.predicted,
        "block_saved_bytes": cb.profile.at(2).blocks[1].saved_bytes,  # the line at 2 (the probes may be 2 and 4)
    }
    if probe is not None and hasattr(probe, "predicted"):
        out["activation"] = {"measured": probe.measured, "predicted": probe.predicted}
    return out


def _static_only(stage: int, precision: str, persistence: int | None = 0) -> dict:
    held = _held_callback()
    _fit(_ds(stage, persistence=persistence), precision, [held])
    return {"held": held.held, "predicted_held": held.predicted}


def _frozen_model():
    import torch
    from lit_models import LitChain

    class FrozenChain(LitChain):
        """Frozen embedding, frozen first block, frozen LayerNorm in the second."""

        def __init__(self):
            super().__init__(n_blocks=N_BLOCKS, d=D_MODEL, lr=1e-3)
            for module in (self.net.embed, self.net.blocks[0], self.net.blocks[1].norm):
                module.requires_grad_(False)

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)

    return FrozenChain()


def _frozen_run() -> dict:
    held = _held_callback()
    _, plain = _fit(_ds(3), "bf16-mixed", [held], model=_frozen_model())
    # named: blocks=None leaves the frozen first block out (its output needs no gradient, so it saves nothing)
    cb = _callback(blocks="net.blocks")
    error = None
    try:
        _, model = _fit(_ds(3), "bf16-mixed", [cb], model=_frozen_model())
    except Exception as err:  # noqa: BLE001 - reported, not raised: the other rank must not wait for this one
        error, model = f"{type(err).__name__}: {err}", None
    return {
        "error": error,
        "losses_plain": _losses(plain),
        "losses_ckpt": _losses(model) if model is not None else [],
        "segments": [list(s) for s in cb.plan.segments] if cb.plan is not None else [],
        "names": list(cb.block_names),
        "held": held.held,
        "predicted_held": held.predicted,
    }


def _skew_run(rank: int) -> dict:
    """Plan by measured time with a skew: rank 0's blocks look slower the deeper they are,
    rank 1's the shallower. The budget lets about half the blocks be checkpointed."""
    import torch.distributed as dist

    from lightning_ckpt.planning.policies import make_plan
    from lightning_ckpt.profiling.passes import profiler

    first = _callback(policy="none")
    _fit(_ds(2), "32-true", [first])
    budget = [None]
    if rank == 0:
        none = make_plan(first.cost, "none").predicted_peak_bytes
        full = make_plan(first.cost, "full").predicted_peak_bytes
        budget = [(none + full) // 2]
    dist.broadcast_object_list(budget, src=0)

    original = profiler._time_blocks

    def skewed(*args, **kwargs):
        times = original(*args, **kwargs)
        n = len(times)
        return [10.0 * (1 + (i if rank == 0 else n - 1 - i)) for i in range(n)]

    profiler._time_blocks = skewed
    try:
        cb = _callback(policy="optimal", cost_metric="ms", memory_budget=budget[0])
        trainer, model = _fit(_ds(2), "32-true", [cb])
    finally:
        profiler._time_blocks = original
    # what this rank would have planned alone, from its own profile (rank 1 profiled, but did not plan)
    from lightning_ckpt.engine.target_plan import cost_at

    cost = cost_at(cb.profile, BATCH, trainer.strategy.ckpt_static_memory(model))
    local = make_plan(cost, "optimal", budget[0], metric="ms")
    return {
        "applied": [list(s) for s in cb.plan.segments],
        "plan": cb.plan.to_dict(),
        "local": [list(s) for s in local.segments],
        "fwd_ms": [b.fwd_ms for b in cb.profile.probes[1].blocks],
        "budget": budget[0],
    }


def _injected_failures(rank: int) -> dict:
    """Profiling raises on one rank only (a non-ValueError): first rank 1, then rank 0."""
    import warnings

    from lightning_ckpt.frontends.lightning import profile_step

    original = profile_step.profile_model
    out = {}
    for failing in (1, 0):

        def broken(*args, failing=failing, **kwargs):
            if rank == failing:
                raise RuntimeError(f"injected failure on rank {failing}")
            return original(*args, **kwargs)

        profile_step.profile_model = broken
        cb = _callback()
        error, warned = None, False
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _fit("ddp", "32-true", [cb])
            warned = any("failed to profile" in str(w.message) for w in caught)
        except Exception as err:  # noqa: BLE001 - recorded for the test; both ranks must get here, not hang
            error = f"{type(err).__name__}: {err}"
        finally:
            profile_step.profile_model = original
        out[f"rank{failing}"] = {
            "error": error, "warned": warned, "segments": [list(s) for s in cb.plan.segments] if cb.plan else None,
        }
    return out


def _ddp_shapes_run() -> dict:
    """DDP with batches padded per batch: the ranks' batches have different lengths at every step."""
    import lightning.pytorch as pl
    from hf_models import LitHF, PaddedTextData, StepPeaks, tiny_bert

    from lightning_ckpt import ActivationCheckpointing

    class Applied(pl.Callback):
        def __init__(self, cb):
            self.cb, self.rows = cb, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            plan = self.cb.plan
            self.rows.append({"length": int(batch["input_ids"].shape[1]), "segments": [list(s) for s in plan.segments],
                              "predicted": plan.predicted_peak_bytes, "planned_length": self.cb.engine.shape.shapes[0][1]})

    pl.seed_everything(0, verbose=False)
    cb = ActivationCheckpointing(4, memory_budget="1GiB", policy="full", verbose=False, report=False)
    applied, peaks = Applied(cb), StepPeaks()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, applied, peaks],
    )
    trainer.fit(LitHF(tiny_bert(layers=2)), datamodule=PaddedTextData([16, 32, 24], batch_size=8))
    grads = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters())
    return {"rows": applied.rows, "peaks": peaks.peaks, "profiled": cb.profiled_steps, "grad_bytes": grads}


def _pair(strategy: str, precision: str) -> dict:
    _, plain = _fit(strategy, precision, [])
    cb = _callback()
    _, model = _fit(strategy, precision, [cb])
    return {
        "losses_plain": _losses(plain),
        "losses_ckpt": _losses(model),
        "segments": [list(s) for s in cb.plan.segments],
        "plan": {k: v for k, v in cb.plan.to_dict().items() if k != "rows"},
    }


if __name__ == "__main__":  # pragma: no cover - a rank of the two-rank job
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    _worker(Path(sys.argv[1]))  # writes this rank's results
    # Leave without the interpreter's teardown: there a thread of the communication
    # libraries can abort the process after every result is written (SIGABRT seen once).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
