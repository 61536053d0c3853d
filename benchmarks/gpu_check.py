"""Does the plan hold for the memory the device really uses? One command, both examples.

    python benchmarks/gpu_check.py                      # CUDA, at most ~8 minutes on one GPU
    python benchmarks/gpu_check.py --fsdp-offload-only  # CUDA, the FSDP2 CPU-offload case alone, ~1 minute
    OMP_NUM_THREADS=1 python benchmarks/gpu_check.py --device cpu --quick   # smoke run (CI), ~20 s

For the encoder (48 blocks, batch 16) and the CNN (stem + 8 blocks, batch 64), in fp32 and
bf16-mixed (autocast), it profiles the step as the callback does and runs `none`, `full` and
`optimal` at two budgets (1/3 and 2/3 of the way from the `full` peak to the `none` peak), plus
the encoder's lower-budget plan once under `torch.compile`. On CUDA it also runs the encoder under
FSDP2 with `CPUOffloadPolicy` on one rank (`fully_shard` per block and on the root): shards,
gradients and AdamW's state in pinned host memory, `full` and `optimal` at the lower budget planned
against the offload model (its host bytes printed), the device peak read by the allocator. Per run: predicted peak, max
allocated and max reserved (CUDA; on CPU the tracked peak and the RSS peak above the run's
start), and the step time as a ratio to `none`. The CUDA allocator is set as the callback
sets it (expandable segments unless PYTORCH_CUDA_ALLOC_CONF is set; glibc malloc on CPU).
Exits 1 if any planned run exceeds its budget in reserved memory (on CPU: in tracked bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]

from _examples import CNN_CHAIN, cnn_example, encoder_example  # noqa: E402

import lightning_ckpt as lc  # noqa: E402
from lightning_ckpt.engine.target_plan import cost_at  # noqa: E402
from lightning_ckpt.profiling.memory.allocator import follow_tensors  # noqa: E402
from lightning_ckpt.profiling.memory.rss import RssPeak, current_rss_bytes  # noqa: E402
from lightning_ckpt.profiling.memory.step_peak import state_tensors  # noqa: E402
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker  # noqa: E402

MIB = 2**20
FRACTIONS = (1 / 3, 2 / 3)


def _to(batch, device):
    return tuple(t.to(device) for t in batch)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _measured(device, model, opt, batch):
    """Peaks of what runs inside: {"allocated", "reserved"} (CUDA) or {"allocated": tracked, "reserved": RSS}."""
    out: dict[str, int | None] = {}
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        _sync(device)
        out["allocated"] = int(torch.cuda.max_memory_allocated(device))
        out["reserved"] = int(torch.cuda.max_memory_reserved(device))
        return
    start = current_rss_bytes()
    with RssPeak() as rss, LiveBytesTracker() as tracker:
        tracker.adopt(state_tensors(model, opt) + list(batch))
        tracker.reset_peak()
        yield out
    out["allocated"] = tracker.peak_bytes
    out["reserved"] = None if rss.peak_bytes is None or start is None else rss.peak_bytes - start


def run_case(name: str, precision: str, device: torch.device, quick: bool, steps: int, compile_too: bool) -> list[dict]:
    """Profile, plan and run one model at one precision; -> one row per run."""
    model, batch, bs = (encoder_example if name == "encoder" else cnn_example)(quick)
    model = model.to(device)
    batch = _to(batch, device)
    chain = "blocks" if name == "encoder" else CNN_CHAIN
    _, names, blocks = lc.resolve_blocks(model, chain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=device.type == "cuda")
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16-mixed" else contextlib.nullcontext
    )

    def loss_fn(b, m=model):
        with autocast():
            return F.cross_entropy(m(b[0]), b[1])

    def step(b, m=model, o=opt):
        loss = loss_fn(b, m)
        o.zero_grad()
        loss.backward()
        o.step()

    step(batch)  # one real step: gradients and AdamW state exist, as the plan assumes
    profile = lc.profile_model(model, blocks, loss_fn, batch, (1, 2), 4, names=names, timing=not quick)
    cost = cost_at(profile, bs, lc.static_memory(model, [opt]))
    lo, hi = (lc.make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
    plans = [("none", lc.make_plan(cost, "none"), None), ("full", lc.make_plan(cost, "full"), None)]
    for f in FRACTIONS:
        budget = int(lo + f * (hi - lo))
        plans.append((f"optimal {100 * f:.0f} %", lc.make_plan(cost, "optimal", budget), budget))
    if compile_too:
        plans.append(("optimal 33 % compiled", plans[2][1], plans[2][2]))
    rows = []
    for label, plan, budget in plans:
        applied = lc.apply_plan(blocks, plan)
        runner = torch.compile(model) if "compiled" in label else model
        try:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # reserved memory of earlier runs does not count for this one
            peaks, times, error = _timed_steps(device, model, opt, batch, steps, lambda b=batch, r=runner: step(b, r),
                                               warm=2 if "compiled" in label else 1)  # (compiles once)
        finally:
            applied.remove()
        rows.append({
            "model": name, "precision": precision, "run": label, "budget": budget, "predicted": plan.predicted_peak_bytes,
            "checkpointed": f"{len(plan.checkpointed)}/{plan.n_blocks}", "allocated": peaks["allocated"],
            "reserved": peaks["reserved"], "step_s": statistics.median(times), "error": error,
        })
    del model, opt, batch
    return rows


def run_fsdp_offload(device: torch.device, quick: bool, steps: int) -> list[dict]:
    """The encoder under FSDP2 with `CPUOffloadPolicy` on one rank of its own process group; -> a row per
    plan, as `run_case`'s. Meant for CUDA: on the CPU (a smoke run of this code) the policy moves nothing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from lightning_ckpt.profiling.memory.fsdp_memory import model_fsdp_memory

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, batch, bs = encoder_example(quick)  # built on the CPU, where CPU offloading wants the parameters
        batch = _to(batch, device)
        _, names, blocks = lc.resolve_blocks(model, "blocks")
        mesh = init_device_mesh(device.type, (1,))
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs an accelerator
        for block in blocks:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # steps the host shards, on the CPU

        def loss_fn(b, m=model):
            return F.cross_entropy(m(b[0]), b[1])

        def step(b):
            loss = loss_fn(b)
            opt.zero_grad()
            loss.backward()
            opt.step()

        step(batch)  # gradients and AdamW state exist, FSDP2's groups are initialised
        profile = lc.profile_model(model, blocks, loss_fn, batch, (1, 2), 4, names=names, timing=False)
        memory = model_fsdp_memory(model)
        cost = cost_at(profile, bs, memory.to_static_memory())
        lo, hi = (lc.make_plan(cost, p).predicted_peak_bytes for p in ("full", "none"))
        budget = int(lo + FRACTIONS[0] * (hi - lo))
        print(f"gpu_check: FSDP2 CPU offload: {memory.host_bytes / MIB:.1f} MiB in host memory per rank "
              f"({', '.join(f'{w} {n / MIB:.1f} MiB' for w, n in memory.host_parts)})")
        rows = []
        for label, plan, limit in (("full", lc.make_plan(cost, "full"), None),
                                   ("optimal 33 %", lc.make_plan(cost, "optimal", budget), budget)):
            applied = lc.apply_plan(blocks, plan)
            try:
                peaks, times, error = _timed_steps(device, model, opt, batch, steps, lambda: step(batch))
            finally:
                applied.remove()
            rows.append({
                "model": "encoder-fsdp2-offload", "precision": "fp32", "run": label, "budget": limit,
                "predicted": plan.predicted_peak_bytes, "checkpointed": f"{len(plan.checkpointed)}/{plan.n_blocks}",
                "allocated": peaks["allocated"], "reserved": peaks["reserved"], "step_s": statistics.median(times),
                "error": error,
            })
        return rows
    finally:
        if own_group:
            dist.destroy_process_group()


def _timed_steps(device, model, opt, batch, steps: int, run, warm: int = 1) -> tuple[dict, list[float], str | None]:
    """`warm` steps, then `steps` timed and measured (`_measured`) -> (peaks, seconds per step, error). A failing
    run is a row of the table, not the end of the check: its error is returned."""
    try:
        for _ in range(warm):
            run()
        times = []
        with _measured(device, model, opt, batch) as peaks:
            for _ in range(steps):
                _sync(device)
                t0 = time.perf_counter()
                run()
                _sync(device)
                times.append(time.perf_counter() - t0)
        return peaks, times, None
    except Exception as err:
        return {"allocated": None, "reserved": None}, [float("nan")], f"{type(err).__name__}: {err}"


def _mib(n) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="small models, fp32 only, no compile: a smoke run")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per run (default 5, quick 1)")
    ap.add_argument("--fsdp-offload-only", action="store_true", help="CUDA: only the FSDP2 CPU-offload case")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device; run on a GPU machine or pass --device cpu.")
        return 2
    if args.fsdp_offload_only and args.device != "cuda":
        print("gpu_check: --fsdp-offload-only needs CUDA (on the CPU, CPUOffloadPolicy moves nothing).")
        return 2
    device = torch.device(args.device)
    steps = args.steps or (1 if args.quick else 5)
    precisions = ["fp32"] if args.quick else ["fp32", "bf16-mixed"]
    setting = follow_tensors(device.type)
    started = time.time()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_check: torch {torch.__version__}, {name}, {'quick' if args.quick else 'full'} run; allocator: "
          f"{setting.action} ({setting.kind})")
    rows = []
    for model in () if args.fsdp_offload_only else ("encoder", "cnn"):
        for precision in precisions:
            compile_too = model == "encoder" and precision == "fp32" and not args.quick
            rows += run_case(model, precision, device, args.quick, steps, compile_too)
    if device.type == "cuda":
        rows += run_fsdp_offload(device, args.quick, steps)
    setting.restore()
    alloc_name, res_name = ("max allocated", "max reserved") if device.type == "cuda" else ("tracked peak", "RSS above start")
    print(f"\n| model | precision | run | checkpointed | budget MiB | predicted MiB | {alloc_name} MiB | {res_name} MiB "
          "| pred. error | x none | over budget |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failed = []
    none_time: dict[tuple, float] = {}
    for r in rows:
        key = (r["model"], r["precision"])
        if r["run"] == "none":
            none_time[key] = r["step_s"]
        gate = r["reserved"] if device.type == "cuda" else r["allocated"]
        over = r["budget"] is not None and (gate is None or gate > r["budget"])
        if over or r["error"]:
            failed.append(r)
        err = "-" if r["allocated"] is None else f"{100 * (r['predicted'] - r['allocated']) / r['allocated']:+.1f} %"
        ratio = r["step_s"] / none_time[key] if key in none_time else float("nan")
        print(f"| {r['model']} | {r['precision']} | {r['run']} | {r['checkpointed']} | {_mib(r['budget'])} | "
              f"{_mib(r['predicted'])} | {_mib(r['allocated'])} | {_mib(r['reserved'])} | {err} | {ratio:.2f} | "
              f"{'YES' if over else ('-' if r['budget'] is None else 'no')} |")
    for r in failed:
        print(f"FAILED: {r['model']} {r['precision']} {r['run']}: " + (r["error"] or "over its budget"))
    gate = "reserved memory" if device.type == "cuda" else "tracked bytes"
    print(f"\n{len(rows)} runs, {len(failed)} failed (gate: planned runs within their budget in {gate}); "
          f"{time.time() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
