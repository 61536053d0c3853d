"""FSDP2's per-rank memory model, and the callback under sharded training on two CPU ranks (gloo).

The arithmetic is checked on hand-written groups. The slow tests share one two-rank job
(`python tests/test_fsdp_memory.py OUT_DIR`, started as in `test_strategy.py`): Lightning's
`ModelParallelStrategy` with `fully_shard` per block in `configure_model` (fp32, and bf16
parameters with fp32 reduction), and DeepSpeed ZeRO-3 with the model built in `configure_model`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from lightning_ckpt.profiling.memory.fsdp_memory import FsdpGroupSizes, fsdp_memory

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 240  # the job takes about 40 s here; a hang is killed at this point
N_BLOCKS, D_MODEL, SEQ, BATCH, STEPS = 5, 32, 64, 8, 5


def _group(name, padded, local=None, world=2, orig=4, unsharded=4, reshard=True, trainable=True, n_params=4):
    local = padded if local is None else local
    return FsdpGroupSizes(name, padded, local, local if trainable else 0, n_params if trainable else 0, orig,
                          unsharded, world, reshard)


def test_terms_of_each_fsdp2_structure():
    """Root (kept gathered) + three resharding blocks of different sizes, 2 ranks, fp32."""
    groups = [_group("<root>", 100, 98, reshard=False), _group("b0", 10), _group("b1", 30), _group("b2", 20)]
    mem = fsdp_memory(groups, buffer_bytes=8, largest_param_bytes=64)
    assert mem.sharded_param_bytes == 4 * (100 + 10 + 30 + 20)  # padded shards
    assert mem.sharded_grad_bytes == mem.sharded_param_bytes  # views of the padded reduce-scatter output
    assert mem.optimizer_state_bytes == 2 * 4 * (98 + 10 + 30 + 20) + 4 * 4 * 4  # unpadded moments + steps
    # root gathered all along, plus the largest pair of neighbouring blocks (b1 and b2) in the backward
    assert mem.unsharded_param_bytes == 2 * 4 * (100 + 30 + 20)
    assert mem.held_bytes == mem.sharded_param_bytes + mem.sharded_grad_bytes + mem.optimizer_state_bytes + 8
    static = mem.to_static_memory()
    assert static.param_bytes == mem.sharded_param_bytes + mem.unsharded_param_bytes
    assert static.optimizer_transient_bytes == 128


def test_bf16_parameters_and_no_reshard():
    """`MixedPrecisionPolicy(param_dtype=bfloat16)`: all-gathers in bf16, shards and gradients stay fp32;
    without resharding after the forward every group stays gathered; frozen groups have no gradient."""
    groups = [_group("b0", 10, unsharded=2, reshard=False), _group("b1", 10, unsharded=2, reshard=False, trainable=False)]
    mem = fsdp_memory(groups)
    assert mem.unsharded_param_bytes == 2 * 2 * 20
    assert mem.sharded_param_bytes == 4 * 20 and mem.sharded_grad_bytes == 4 * 10
    assert mem.optimizer_state_bytes == 2 * 4 * 10 + 4 * 4


def test_cpu_offload_keeps_only_the_gathered_parameters_on_the_device():
    """`CPUOffloadPolicy` on every group: shards, gradients and optimizer state are host memory (the
    optimizer steps there), the device holds the all-gather outputs and one group's copies of its shards."""
    groups = [_group("<root>", 100, 98, reshard=False), _group("b0", 10), _group("b1", 30), _group("b2", 20)]
    away = [dataclasses.replace(g, offload_to_cpu=True) for g in groups]
    kept, mem = fsdp_memory(groups, largest_param_bytes=64), fsdp_memory(away, largest_param_bytes=64)
    assert (mem.sharded_param_bytes, mem.sharded_grad_bytes, mem.optimizer_state_bytes) == (0, 0, 0)
    assert (mem.host_param_bytes, mem.host_grad_bytes, mem.host_optimizer_state_bytes) == (
        kept.sharded_param_bytes, kept.sharded_grad_bytes, kept.optimizer_state_bytes)
    assert mem.unsharded_param_bytes == kept.unsharded_param_bytes and mem.offload_copy_bytes == 4 * 100
    assert mem.held_bytes == kept.held_bytes  # the same bytes, elsewhere
    static = mem.to_static_memory()
    assert static.resident_bytes == mem.unsharded_param_bytes + 4 * 100
    assert not static.grads_on_device and static.optimizer_transient_bytes == 0
    assert static.host_bytes == kept.sharded_param_bytes + kept.sharded_grad_bytes + kept.optimizer_state_bytes
    # one group left on the device keeps its gradients there
    mixed = fsdp_memory([groups[0], *away[1:]]).to_static_memory()
    assert mixed.grads_on_device and mixed.host_bytes == 4 * 60 * 2 + (2 * 4 * 60 + 3 * 4 * 4)


@pytest.mark.timeout(120)
def test_cpu_offload_policy_against_the_sharded_tensors_fsdp2_keeps():
    """One gloo rank in this process, `fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))`
    per block and on the root, AdamW, two steps. On CPU the policy moves nothing (its default pins memory,
    which needs an accelerator), so the check is of the static model against the tensors FSDP2 made for
    the host: its padded shards (the parameters' local tensors view them), their gradients and the
    optimizer state, counted from the module and the optimizer as unique storages."""
    import torch
    import torch.distributed as dist
    from models import TinyChain
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from lightning_ckpt.frontends.lightning.strategy_hooks import strategy_static_memory
    from lightning_ckpt.profiling.memory.fsdp_memory import fsdp_host_tensors, model_fsdp_memory
    from lightning_ckpt.profiling.memory.tracker import local_tensor, unique_storage_bytes

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process; this test needs it free")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = TinyChain(n_blocks=3, d=16)
        mesh = init_device_mesh("cpu", (1,))
        policy = CPUOffloadPolicy(pin_memory=False)
        for block in net.blocks:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(net, mesh=mesh, offload_policy=policy)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        x = torch.randint(0, 50, (2, 5))
        for _ in range(2):
            opt.zero_grad()
            net(x).sum().backward()
            opt.step()
        mem = model_fsdp_memory(net)
        params = list(net.parameters())
        host = [local_tensor(p) for p in params] + [local_tensor(p.grad) for p in params]
        host += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        assert mem.host_bytes == unique_storage_bytes(host) > 0
        assert unique_storage_bytes(fsdp_host_tensors(net, [opt])) == mem.host_bytes
        assert (mem.sharded_param_bytes, mem.sharded_grad_bytes, mem.optimizer_state_bytes) == (0, 0, 0)
        assert mem.unsharded_param_bytes > 0  # the root's all-gather outputs, kept gathered, stay on the device

        class Trainer:  # what `strategy_static_memory` reads of a trainer
            strategy, optimizers = object(), [opt]

        static = strategy_static_memory(Trainer(), net)
        assert static.host_bytes == mem.host_bytes and not static.grads_on_device
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- two CPU ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from rank_jobs import launch_ranks

    out = tmp_path_factory.mktemp("fsdp_ranks")
    return launch_ranks(2, [__file__, str(out)], out, JOB_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("run", ["fp32/every_k", "fp32/optimal", "bf16/every_k"])
def test_fsdp2_losses_equal_without_checkpointing(ranks, run):
    """`fully_shard` per block in `configure_model`, dropout 0: losses over 5 steps equal the run
    without the callback bit for bit (the recompute calls each block as a module, so FSDP2
    all-gathers its parameters again and repeats the same ops on the same values), rank 0's plan on
    both ranks. `every_k` exercises two-block segments; `optimal` plans within a budget between
    the peaks of checkpointing nothing and everything."""
    for r in ranks:
        found = r[run]
        assert found["segments"] and len(found["losses_ckpt"]) == STEPS
        assert found["losses_ckpt"] == found["losses_plain"], (r["rank"], found)
        assert found["chains"] == [True] * N_BLOCKS
    assert ranks[0][run]["plan"] == ranks[1][run]["plan"]
    assert ranks[0][run]["losses_plain"] != ranks[1][run]["losses_plain"]  # each rank saw its own data
    if run.endswith("every_k"):
        assert ranks[0][run]["segments"] == [[0, 1], [2, 3], [4, 4]]
    else:
        assert 0 < sum(b - a + 1 for a, b in ranks[0][run]["segments"]) < N_BLOCKS


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("run", ["fp32/every_k", "bf16/every_k"])
def test_fsdp2_static_memory_within_2_percent(ranks, run):
    """The model's per-rank bytes against FSDP2's live structures after the last step."""
    for r in ranks:
        found = r[run]
        assert abs(found["predicted_held"] - found["held"]) <= 0.02 * found["held"], (r["rank"], found)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("run", ["fp32/every_k", "bf16/every_k"])
def test_fsdp2_step_peak_within_10_percent(ranks, run):
    """The plan's predicted peak against the tracker's measured peak of the first planned step (model
    state adopted), plus the all-gather outputs alive at the time (storage resizes no op creates)."""
    found = ranks[0][run]
    assert abs(found["predicted_peak"] - found["measured_peak"]) <= 0.10 * found["measured_peak"], found


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_zero3_network_built_in_configure_model(ranks):
    """DeepSpeed ZeRO-3, bf16, the network built in `configure_model` (under `zero.Init`, partitioned
    from birth): same profile and static memory as the network built in `__init__`, losses equal
    without checkpointing, the same plan on both ranks."""
    for r in ranks:
        found = r["zero3"]
        assert found["segments"] == [[0, 1], [2, 3], [4, 4]]
        assert found["losses_ckpt"] == found["losses_plain"] and len(found["losses_ckpt"]) == STEPS
        assert found["static_lazy"] == found["static_eager"]
        assert found["saved_lazy"] == found["saved_eager"]
    assert ranks[0]["zero3"]["plan"] == ranks[1]["zero3"]["plan"]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_recompute_gather_under_sharding(ranks):
    """ZeRO-3 fetches a checkpointed block's parameters again for its recompute: the backward
    all-gathers exactly the blocks' `gather_bytes` more than without checkpointing. FSDP2's
    recompute runs after the block's pre-backward gather and gathers nothing more: 0 bytes.
    The all-gather rate is measured on both (2 ranks) and travels in rank 0's plan."""
    for r in ranks:
        zero3, fsdp2 = r["zero3"], r["fp32/every_k"]
        assert zero3["gather_bytes"] == zero3["partitioned_bytes"] and min(zero3["gather_bytes"]) > 0
        assert zero3["bwd_gathered"][1] - zero3["bwd_gathered"][0] == sum(zero3["gather_bytes"])
        assert fsdp2["gather_bytes"] == [0] * N_BLOCKS
        assert fsdp2["bwd_gathered"][0] == fsdp2["bwd_gathered"][1] > 0
        for found in (zero3, fsdp2):
            assert found["plan"]["rates"]["gather_byte_per_s"] > 0


# ---------------------------------------------------------------------------- the ranks' side


def _worker(out_dir: Path) -> None:  # pragma: no cover - runs in the spawned ranks
    import faulthandler

    faulthandler.dump_traceback_later(JOB_TIMEOUT_S - 20, exit=True)
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["LOCAL_RANK"])
    results: dict = {"rank": rank}
    for precision in ("fp32", "bf16"):
        results[f"{precision}/every_k"], cost = _fsdp_pair(precision, policy="every_k", every_k=2)
        if precision == "fp32":
            budget = [_midpoint_budget(cost) if cost is not None else None]
            torch.distributed.broadcast_object_list(budget, src=0)
            results["fp32/optimal"], _ = _fsdp_pair(precision, policy="optimal", memory_budget=budget[0])
    results["zero3"] = _zero3_lazy()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


def _midpoint_budget(cost) -> int:
    from lightning_ckpt.planning.policies import make_plan

    none, full = make_plan(cost, "none").predicted_peak_bytes, make_plan(cost, "full").predicted_peak_bytes
    return (none + full) // 2


def _fit(strategy, model, callbacks, precision="32-true"):
    import lightning.pytorch as pl
    from lit_models import TokenData

    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=TokenData(batch_size=BATCH, n=64, seq=SEQ))
    print(f"fit {type(strategy).__name__} {[type(c).__name__ for c in callbacks]}: "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return trainer


def _fsdp_model(precision: str):
    import lightning.pytorch as pl
    import torch
    from lit_models import LitLazyChain
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class ShardedChain(LitLazyChain):
        """`fully_shard` per block, then the root, over the data-parallel mesh."""

        def configure_model(self) -> None:
            if self.net is not None:
                return
            super().configure_model()
            kw = {"mesh": self.device_mesh["data_parallel"]}
            if precision == "bf16":
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in self.net.blocks:
                fully_shard(block, **kw)
            fully_shard(self.net, **kw)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    pl.seed_everything(0, verbose=False)
    return ShardedChain(n_blocks=N_BLOCKS, d=D_MODEL, p=0.0, lr=1e-3)


def _fsdp_pair(precision: str, **cb_kw) -> tuple[dict, object]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_ckpt import ActivationCheckpointing
    from lightning_ckpt.profiling.memory.fsdp_memory import fsdp_held_bytes, model_fsdp_memory

    def strategy():
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)

    plain, plain_gathers = _fsdp_model(precision), _backward_gathers()
    _fit(strategy(), plain, [plain_gathers])

    class Held(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == STEPS:
                self.held = fsdp_held_bytes(pl_module, trainer.optimizers)
                self.predicted = model_fsdp_memory(pl_module).held_bytes

    cb_kw.setdefault("memory_budget", "1GiB")
    cb = ActivationCheckpointing(target_batch_size=BATCH, verbose=False, report=False, **cb_kw)
    held, peak, gathers = Held(), _gathered_peak_probe(), _backward_gathers()
    model = _fsdp_model(precision)
    _fit(strategy(), model, [cb, held, peak, gathers])
    out = {
        "losses_plain": [float(x) for x in plain.losses],
        "losses_ckpt": [float(x) for x in model.losses],
        "segments": [list(s) for s in cb.plan.segments],
        "plan": {k: v for k, v in cb.plan.to_dict().items() if k != "rows"},
        "chains": [b.chains_from_previous for b in cb.profile.probes[1].blocks],
        "held": held.held,
        "predicted_held": held.predicted,
        "measured_peak": peak.peak_bytes,
        "predicted_peak": cb.plan.predicted_peak_bytes,
        "gather_bytes": [b.gather_bytes for b in cb.profile.probes[1].blocks],
        "bwd_gathered": [plain_gathers.nbytes, gathers.nbytes],
    }
    return out, cb.cost


def _backward_gathers():
    """Counts the bytes all-gathered in the backward of the third step (plan applied, steady):
    FSDP2 calls `dist.all_gather_single` (torch 2.13; `all_gather_into_tensor` before), DeepSpeed
    the `all_gather_into_tensor` its comm backend captured at start-up."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    class Count(pl.Callback):
        nbytes = 0

        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.global_step != 2:
                return
            targets = [(dist, n) for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
            if "deepspeed" in sys.modules:
                from deepspeed.comm import comm

                if getattr(comm, "cdb", None) is not None:
                    targets.append((comm.cdb, "all_gather_function"))
            self.saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
            for owner, name, fn in self.saved:
                def counting(*args, fn=fn, **kw):
                    out = kw.get("output_tensor", kw.get("output", args[0] if args else None))
                    self.nbytes += out.numel() * out.element_size()
                    return fn(*args, **kw)

                setattr(owner, name, counting)

        def on_after_backward(self, trainer, pl_module):
            for owner, name, fn in getattr(self, "saved", []):
                setattr(owner, name, fn)
            self.saved = []

    return Count()


def _gathered_peak_probe():
    """Measures the third step (optimizer state exists, as the plan assumes): the tracker's live bytes,
    model state adopted, plus after every op the FSDP2 all-gather outputs allocated at that moment
    (FSDP2 allocates and frees them by resizing storages, which no op reports to the tracker)."""
    import lightning.pytorch as pl

    from lightning_ckpt.profiling.memory.fsdp_memory import fsdp_params
    from lightning_ckpt.profiling.memory.step_peak import state_tensors
    from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker

    class GatheredTracker(LiveBytesTracker):
        def __init__(self, outputs):
            super().__init__()
            self.outputs, self.with_gathered = outputs, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            gathered = sum(t.untyped_storage().nbytes() for t in self.outputs)
            self.with_gathered = max(self.with_gathered, self.live_bytes + gathered)
            return out

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                outputs = [t for p in fsdp_params(pl_module) for t in p.all_gather_outputs]
                state = [t for o in trainer.optimizers for s in o.state.values() for t in s.values()]
                self.tracker = GatheredTracker(outputs).__enter__()
                self.tracker.adopt(state_tensors(pl_module) + state)
                self.tracker.reset_peak()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.tracker.__exit__(None, None, None)
                self.peak_bytes = max(self.tracker.peak_bytes, self.tracker.with_gathered)

    return Probe()


def _zero3_lazy() -> dict:


    import lightning.pytorch as pl
    from lit_models import LitChain, LitLazyChain

    from lightning_ckpt import ActivationCheckpointing, DeepSpeedStrategy

    def strategy():
        return DeepSpeedStrategy(stage=3, param_persistence_threshold=0, reduce_bucket_size=2**20,
                                 allgather_bucket_size=2**20, logging_level=40)

    def model(cls):
        pl.seed_everything(0, verbose=False)
        return cls(n_blocks=N_BLOCKS, d=D_MODEL, lr=1e-3)

    plain, plain_gathers, gathers = model(LitLazyChain), _backward_gathers(), _backward_gathers()
    _fit(strategy(), plain, [plain_gathers], precision="bf16-mixed")
    found = {}
    for cls in (LitChain, LitLazyChain):
        cb = ActivationCheckpointing(target_batch_size=BATCH, memory_budget="1GiB", policy="every_k", every_k=2,
                                     verbose=False, report=False)
        trainer = _fit(strategy(), model(cls), [cb] + ([gathers] if cls is LitLazyChain else []), precision="bf16-mixed")
        static = trainer.strategy.zero_memory(trainer.lightning_module)
        found[cls] = cb, trainer.lightning_module, [static.param_bytes, static.grad_bytes, static.held_bytes]
    (eager, _, static_eager), (lazy, lazy_model, static_lazy) = found[LitChain], found[LitLazyChain]
    return {
        "losses_plain": [float(x) for x in plain.losses],
        "losses_ckpt": [float(x) for x in lazy_model.losses],
        "segments": [list(s) for s in lazy.plan.segments],
        "plan": {k: v for k, v in lazy.plan.to_dict().items() if k != "rows"},
        "static_lazy": static_lazy,
        "static_eager": static_eager,
        "saved_lazy": [b.saved_bytes for b in lazy.profile.at(2).blocks],  # the line at 2, whichever slices defined it
        "saved_eager": [b.saved_bytes for b in eager.profile.at(2).blocks],
        "gather_bytes": [b.gather_bytes for b in lazy.profile.probes[1].blocks],
        "partitioned_bytes": [sum(p.ds_numel * p.element_size() for p in b.parameters()) for b in lazy_model.net.blocks],
        "bwd_gathered": [plain_gathers.nbytes, gathers.nbytes],
    }


if __name__ == "__main__":  # pragma: no cover - a rank of the two-rank job
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    _worker(Path(sys.argv[1]))  # writes this rank's results
    # Leave without the interpreter's teardown: there a thread of the communication
    # libraries can abort the process after every result is written (SIGABRT seen once).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
