"""The ranks' side of `test_tensor_parallel.py`: a Llama-like model parallelised in `configure_model`,
each configuration trained with and without the callback, and a per-rank measurement of the step.

The measured peak is that of the third step (optimizer state exists) under a tracker of every storage
an op makes on this rank, the local ops inside DTensor's dispatch included, with the model state and
the batch adopted, plus FSDP2's all-gather outputs alive at each op (allocated by resizing storages,
which no op reports). Every configuration also prints a `table` line: the docs' table.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt.profiling.work.tp_work import has_dtensor
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker
from test_tensor_parallel import BATCH, D_MODEL, MEASURED_STEP, N_BLOCKS, SEQ, STEPS, VOCAB
from tp_models import LlamaBlock, tp_plan


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(LlamaBlock(D_MODEL) for _ in range(N_BLOCKS))
        self.norm = nn.RMSNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class LitLlama(pl.LightningModule):
    """`sp`: sequence parallelism; `lp`: `loss_parallel` (logits stay sharded over the vocabulary);
    `fsdp`: FSDP2 per block and the root over the data-parallel mesh, after tensor parallelism."""

    def __init__(self, sp: bool = False, lp: bool = False, fsdp: bool = False) -> None:
        super().__init__()
        self.sp, self.lp, self.fsdp = sp, lp, fsdp
        self.net: Net | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

        if self.net is not None:
            return
        torch.manual_seed(0)
        self.net = Net()
        mesh = self.device_mesh["tensor_parallel"]
        seq = Shard(1) if self.sp else Replicate()
        plan = {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if self.lp else Replicate(),
                                    use_local_output=not self.lp),
        }
        if self.sp:
            plan["norm"] = SequenceParallel()
        parallelize_module(self.net, mesh, plan)
        for block in self.net.blocks:
            parallelize_module(block, mesh, tp_plan(self.sp))
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in self.net.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def _loss(self, batch):
        x, y = batch
        logits = self.net(x)
        if self.lp:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                return F.cross_entropy(logits.flatten(0, 1), y.flatten())
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def backward(self, loss, *args, **kwargs):
        if self.lp:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss.backward(*args, **kwargs)
        else:
            loss.backward(*args, **kwargs)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        loss = outputs["loss"].detach()
        self.losses.append(float(loss.full_tensor() if has_dtensor(loss) else loss))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Tokens(pl.LightningDataModule):
    def __init__(self, batch_size: int = BATCH, n: int = 256) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        self.ds = TensorDataset(t[:, :-1], t[:, 1:])

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size, shuffle=False)


class LocalStorageTracker(LiveBytesTracker):
    """Every storage an op makes on this rank: ops on DTensors are left to DTensor's dispatch, whose
    local ops (and redistributions) come back here; `outputs`: storages allocated by resizing
    (FSDP2's all-gather outputs), added at every op."""

    def __init__(self, outputs=()):
        super().__init__()
        self.outputs, self.with_outputs = list(outputs), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if has_dtensor((args, kwargs or {})):
            return NotImplemented
        out = super().__torch_dispatch__(func, types, args, kwargs)
        gathered = sum(t.untyped_storage().nbytes() for t in self.outputs)
        self.with_outputs = max(self.with_outputs, self.live_bytes + gathered)
        return out


class StepProbe(pl.Callback):
    """The measured peak of step `MEASURED_STEP` and the bytes held after the last step."""

    peak_bytes = held_bytes = predicted_held = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != MEASURED_STEP:
            return
        from lightning_ckpt.profiling.structure.batch import tensors_in
        from lightning_ckpt.profiling.memory.fsdp_memory import fsdp_params
        from lightning_ckpt.profiling.memory.step_peak import state_tensors

        outputs = [t for p in fsdp_params(pl_module) for t in p.all_gather_outputs]
        state = [t for o in trainer.optimizers for s in o.state.values() for t in s.values()]
        self.tracker = LocalStorageTracker(outputs).__enter__()
        self.tracker.adopt(state_tensors(pl_module) + state + list(tensors_in(batch)))
        self.tracker.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == MEASURED_STEP + 1 and self.peak_bytes is None:
            self.tracker.__exit__(None, None, None)
            self.peak_bytes = max(self.tracker.peak_bytes, self.tracker.with_outputs)
        if trainer.global_step == STEPS:
            from lightning_ckpt.frontends.lightning.strategy_hooks import strategy_static_memory
            from lightning_ckpt.profiling.memory.fsdp_memory import fsdp_held_bytes, model_fsdp_memory
            from lightning_ckpt.profiling.memory.step_peak import state_tensors
            from lightning_ckpt.profiling.memory.tp_memory import local_nbytes
            from lightning_ckpt.profiling.memory.tracker import storage_bytes, unique_storage_bytes

            fsdp = model_fsdp_memory(pl_module)
            if fsdp is not None:
                self.held_bytes = fsdp_held_bytes(pl_module, trainer.optimizers)
                self.predicted_held = fsdp.held_bytes
            else:
                state = [t for o in trainer.optimizers for s in o.state.values() for t in s.values()]
                self.held_bytes = unique_storage_bytes(state_tensors(pl_module) + state)
                self.odd_grads = [n for n, p in pl_module.named_parameters() if p.grad is not None
                                  and storage_bytes(p.grad) != local_nbytes(p.grad)]
                static = strategy_static_memory(trainer, pl_module)
                self.predicted_held = static.param_bytes + static.buffer_bytes + static.grad_bytes + static.optimizer_state_bytes


def _fit(model, callbacks, dp: int = 1, precision: str = "32-true", data: Tokens | None = None) -> pl.Trainer:
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = pl.Trainer(
        accelerator="cpu", devices=2 * dp, strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=2),
        precision=precision, max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=list(callbacks),
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data or Tokens())
    print(f"fit {[type(c).__name__ for c in callbacks]}: {time.perf_counter() - start:.1f} s", flush=True)
    return trainer


def _callback(**kw):
    from lightning_ckpt import ActivationCheckpointing

    kw.setdefault("target_batch_size", BATCH)
    kw.setdefault("memory_budget", "1GiB")
    # the step is measured here (`StepProbe`); the callback's own measurement would nest a second tracker
    return ActivationCheckpointing(verbose=False, report=False, measure_peak=False, **kw)


def _run(model_kw: dict, cb_kw: dict, dp: int = 1, precision: str = "32-true") -> tuple[dict, object]:
    cb, probe = _callback(**cb_kw), StepProbe()
    model = LitLlama(**model_kw)
    _fit(model, [cb, probe], dp, precision)
    plan = cb.plan
    out = {
        "losses": model.losses,
        "plan": {k: v for k, v in plan.to_dict().items() if k not in ("rows", "rates")},
        "checkpointed": list(plan.checkpointed),
        "predicted_peak": plan.predicted_peak_bytes,
        "measured_peak": probe.peak_bytes,
        "callback_measured_peak": cb.measured_peak_bytes,
        "budget": plan.budget_bytes,
        "fits": plan.fits,
        "held": probe.held_bytes,
        "odd_grads": getattr(probe, "odd_grads", None),
        "predicted_held": probe.predicted_held,
        "fwd_flops": [b.fwd_flops for b in cb.profile.probes[-1].blocks],
        "fwd_comm_bytes": [b.fwd_comm_bytes for b in cb.profile.probes[-1].blocks],
        "grad_bytes": [b.grad_bytes for b in cb.profile.probes[-1].blocks],
        "table": str(plan),
    }
    return out, cb.cost


def _plain(model_kw: dict, dp: int = 1, precision: str = "32-true") -> list[float]:
    model = LitLlama(**model_kw)
    _fit(model, [], dp, precision)
    return model.losses


def _budget_above_full(cost, share: float = 0.4) -> int:
    """Rank 0's budget 40 % of the way from `full`'s predicted peak to checkpointing nothing's."""
    from lightning_ckpt.planning.policies import make_plan

    budget = [None]
    if cost is not None:
        none, full = make_plan(cost, "none").predicted_peak_bytes, make_plan(cost, "full").predicted_peak_bytes
        budget = [int(full + share * (none - full))]
    torch.distributed.broadcast_object_list(budget, src=0)
    return budget[0]


def _table_line(name: str, rank: int, run: dict) -> None:
    mb = 1e6
    print(f"table | {name} | {rank} | {run['plan']['policy']} | {run['budget'] / mb:.2f} MB | "
          f"{len(run['checkpointed'])}/{N_BLOCKS} | {run['predicted_peak'] / mb:.3f} MB | {run['measured_peak'] / mb:.3f} MB | "
          f"{100 * (run['predicted_peak'] / run['measured_peak'] - 1):+.1f} % |", flush=True)


def _pair(name: str, model_kw: dict, dp: int = 1) -> dict:
    """Without the callback; `full`; `optimal` at a budget 40 % of the way from `full`'s peak to none's."""
    found: dict = {"losses_plain": _plain(model_kw, dp)}
    rank = torch.distributed.get_rank()  # the first fit started the process group
    found["full"], cost = _run(model_kw, {"policy": "full"}, dp)
    found["optimal"], _ = _run(model_kw, {"policy": "optimal", "memory_budget": _budget_above_full(cost)}, dp)
    found["held"], found["predicted_held"] = found["full"]["held"], found["full"]["predicted_held"]
    for policy in ("full", "optimal"):
        _table_line(name, rank, found[policy])
    print(found["optimal"]["table"] if rank == 0 else "", flush=True)
    return found


def _infeasible() -> dict:
    """A budget below the model's state: the error and this rank's static terms as the error prints them."""
    from lightning_ckpt.units import format_bytes

    model, cb, static = LitLlama(), _callback(memory_budget="400KB"), {}

    class Static(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            from lightning_ckpt.frontends.lightning.strategy_hooks import strategy_static_memory

            s = strategy_static_memory(trainer, pl_module)
            static.update(grad=format_bytes(s.grad_bytes), optim=format_bytes(s.optimizer_state_bytes))

    try:
        _fit(model, [Static(), cb])
        return {"error": None}
    except Exception as err:  # noqa: BLE001 - the test reads what was raised
        return {"error": type(err).__name__, "message": str(err), **static}


def two_rank_configs() -> dict:
    results = {"tp": _pair("TP=2", {}), "tp_sp": _pair("TP=2 + SP", {"sp": True})}
    budget = results["tp"]["optimal"]["budget"]
    for name, model_kw, cb_kw, precision in (
        ("op_level", {}, {"granularity": "op"}, "32-true"),
        ("loss_parallel", {"lp": True}, {}, "32-true"),
        ("bf16", {}, {}, "bf16-mixed"),
    ):
        run, _ = _run(model_kw, {"memory_budget": budget, **cb_kw}, precision=precision)
        results[name] = {"losses_plain": _plain(model_kw, precision=precision), "run": run}
        _table_line(name, torch.distributed.get_rank(), run)
    results["max"] = _max_batch(results["tp"]["optimal"]["budget"])
    results["infeasible"] = _infeasible()
    return results


def _max_batch(budget: int) -> dict:
    cb, probe, data = _callback(target_batch_size="max", memory_budget=budget), StepProbe(), Tokens()
    _fit(LitLlama(), [cb, probe], data=data)
    return {"batch_size": cb.plan.batch_size, "loader_batch_size": data.batch_size, "measured_peak": probe.peak_bytes,
            "budget": budget, "predicted_peak": cb.plan.predicted_peak_bytes}


def two_dimensional() -> dict:
    return {"2d": _pair("TP=2 x FSDP2=2", {"fsdp": True}, dp=2)}
