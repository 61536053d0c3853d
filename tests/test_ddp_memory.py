"""DDP's gradient buckets on 2 CPU ranks (gloo, spawned): the resident bytes wrapping adds, as measured by
the live-storage tracker, match `ddp_comm_buffer_bytes`; every phase of a step holds them above the
unwrapped model with the default copy, the first forward and each backward's start with bucket views;
`strategy_static_memory` adds them, through Fabric-style wrappers too."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from rank_jobs import free_port
import torch
from torch import nn

from lightning_ckpt.profiling.memory.ddp_memory import ddp_bucket_bytes, ddp_comm_buffer_bytes, find_ddp
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker

WIDTH, BLOCKS, CLASSES, BATCH, STEPS = 256, 4, 10, 128, 4
SLACK = 1024  # bytes: a small buffer of the all-reduce is now and then still alive
SETTINGS = {  # name: DDP keyword arguments
    "copy": {},
    "copy_small_buckets": {"bucket_cap_mb": 0.3},  # several buckets
    "view": {"gradient_as_bucket_view": True},
    "view_static": {"gradient_as_bucket_view": True, "static_graph": True},
}


def _model(frozen_first: bool = False) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
    model = nn.Sequential(*blocks, nn.Linear(WIDTH, CLASSES))
    if frozen_first:
        model[0].requires_grad_(False)
    return model


def _grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _run(wrap, frozen_first: bool = False) -> dict:
    """Wrap a fresh model under the tracker, then train STEPS steps (forward, zero_grad(set_to_none),
    backward, SGD step: Lightning's order); bytes counted above the parameters."""
    import torch.distributed as dist

    model = _model(frozen_first)
    params = [p for p in model.parameters() if p.requires_grad]
    out: dict = {"grad_bytes": _grad_bytes(model)}
    with LiveBytesTracker() as tracker:
        tracker.adopt(model.parameters())
        start = tracker.live_bytes
        wrapped = wrap(model)
        dist.barrier()  # the broadcast of the initial parameters is done and its buffers freed
        gc.collect()
        out["wrap_bytes"] = tracker.live_bytes - start
        out["comm_bytes"] = ddp_comm_buffer_bytes(wrapped)
        opt = torch.optim.SGD(params, lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        peaks, forward_peaks, backward_starts = [], [], []
        for _ in range(STEPS):
            x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
            tracker.reset_peak()
            loss = nn.functional.cross_entropy(wrapped(x), y)
            forward_peaks.append(tracker.peak_bytes - start)
            opt.zero_grad(set_to_none=True)
            backward_starts.append(tracker.live_bytes - start)
            loss.backward()
            opt.step()
            del loss
            peaks.append(tracker.peak_bytes - start)
        out.update(peaks=peaks, forward_peaks=forward_peaks, backward_starts=backward_starts)
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from lightning_ckpt.frontends.lightning.strategy_hooks import strategy_static_memory
    from lightning_ckpt.profiling.memory.static_memory import static_memory

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ddp = nn.parallel.DistributedDataParallel
    results: dict = {"plain": _run(lambda m: m)}
    for name, kwargs in SETTINGS.items():
        results[name] = _run(lambda m, kw=kwargs: ddp(m, **kw))
    results["frozen"] = _run(lambda m: ddp(m), frozen_first=True)
    results["plain_frozen"] = _run(lambda m: m, frozen_first=True)

    # the static memory the callback plans with: trainer.model is the DDP module (Lightning), or holds it
    module = _model()
    opt = torch.optim.AdamW(module.parameters())
    wrapped = ddp(module)
    fabric_like = nn.Module()
    fabric_like._forward_module, fabric_like._original_module = wrapped, module
    rows = {}
    for key, model in (("lightning", wrapped), ("fabric", fabric_like), ("unwrapped", module)):
        trainer = SimpleNamespace(strategy=SimpleNamespace(), optimizers=[opt], model=model)
        static = strategy_static_memory(trainer, module)
        rows[key] = {"comm": static.comm_buffer_bytes, "resident": static.resident_bytes}
    rows["plain_resident"] = static_memory(module, [opt]).resident_bytes
    rows["found"] = find_ddp(fabric_like) is wrapped
    rows["recorded"] = ddp_bucket_bytes(wrapped)
    results["static"] = rows
    results["seconds"] = time.perf_counter() - t0
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


SPAWN_TIMEOUT_S = 100  # the two ranks take about 15 s; a hang ends here, with its own error, before the 120 s


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ddp_memory")
    context = mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):  # raises if a rank failed
        if time.monotonic() >= deadline:
            alive = [r for r, proc in enumerate(context.processes) if proc.is_alive()]
            for r in alive:
                context.processes[r].kill()
                context.processes[r].join(timeout=30)
            pytest.fail(f"DDP ranks {alive} still running after {SPAWN_TIMEOUT_S} s (killed): a collective hangs")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", [*SETTINGS, "frozen"])
def test_wrapping_adds_the_bucket_bytes_the_function_reports(ranks, setting):
    for r in ranks:
        run = r[setting]
        assert run["comm_bytes"] == run["grad_bytes"] > 0, run
        # static_graph adds two 40-byte counters of its own
        assert 0 <= run["wrap_bytes"] - run["comm_bytes"] <= (80 if "static" in setting else 0), run
    # a frozen block has no gradient slot; each backward starts with the buckets held (the 2nd, where DDP
    # rebuilds them, perhaps the old ones too: see the copy's test)
    assert ranks[0]["frozen"]["comm_bytes"] == ranks[0]["copy"]["comm_bytes"] - (WIDTH * WIDTH + WIDTH) * 4
    if setting == "frozen":
        for r in ranks:
            comm = r["frozen"]["comm_bytes"]
            starts = [b - q for b, q in zip(r["frozen"]["backward_starts"], r["plain_frozen"]["backward_starts"])]
            assert all(comm <= b <= (2 if k == 1 else 1) * comm + SLACK for k, b in enumerate(starts)), starts


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["copy", "copy_small_buckets"])
def test_with_the_copy_every_phase_holds_the_buckets_above_the_unwrapped_model(ranks, setting):
    """The step where DDP rebuilds its buckets (the 2nd) may hold the old ones too (seen in about one
    run in three: something of the last all-reduce still refers to them)."""
    for r in ranks:
        plain, run, comm = r["plain"], r[setting], r[setting]["comm_bytes"]
        for phase in ("forward_peaks", "backward_starts", "peaks"):
            extra = [p - q for p, q in zip(run[phase], plain[phase])]
            assert all(comm <= e <= (2 if k == 1 else 1) * comm + SLACK for k, e in enumerate(extra)), (phase, extra)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["view", "view_static"])
def test_with_bucket_views_the_buckets_stay_held_while_the_gradients_are_none(ranks, setting):
    """Every backward starts with the buckets held (the gradients are None, the buckets are not), and the
    first forward holds them with no gradient yet. Rebuilding its buckets (the 2nd step, the 3rd with
    static_graph) DDP allocates new ones while the old ones are the gradients; the old ones may live into
    that step's backward (a reference cycle), so until then a step may hold up to two."""
    counters = 80 if "static" in setting else 0  # static_graph's own two 40-byte tensors
    for r in ranks:
        plain, run, comm = r["plain"], r[setting], r[setting]["comm_bytes"]
        starts = [p - q - counters for p, q in zip(run["backward_starts"], plain["backward_starts"])]
        assert all(comm <= b <= 2 * comm for b in starts), starts
        assert run["forward_peaks"][0] - plain["forward_peaks"][0] - counters == comm
        extra = [p - q - counters for p, q in zip(run["peaks"], plain["peaks"])]
        assert all(0 < e <= 2 * comm for e in extra) and all(e <= comm for e in extra[3:]), extra


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_strategy_static_memory_counts_the_buckets_through_wrappers(ranks):
    for r in ranks:
        rows = r["static"]
        assert rows["found"]
        assert rows["lightning"]["comm"] == rows["fabric"]["comm"] == rows["recorded"] == _grad_bytes(_model())
        assert rows["lightning"]["resident"] == rows["plain_resident"] + rows["recorded"]
        assert rows["unwrapped"] == {"comm": 0, "resident": rows["plain_resident"]}
