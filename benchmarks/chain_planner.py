"""Planning time of the `optimal` chain planner: the fast solver against the original DP.

    OMP_NUM_THREADS=1 python benchmarks/chain_planner.py        # a few minutes, mostly the original DP
    OMP_NUM_THREADS=1 python benchmarks/chain_planner.py --sizes 1000 --old-max-n 0 \
        --shapes uniform encoder stages random "encoder~5%"     # the n = 1,000 claim, ~30 s
    OMP_NUM_THREADS=1 python benchmarks/chain_planner.py --sizes 48 1000 --old-max-n 0 \
        --shapes encoder "encoder~5%" --time-limit 2            # under make_plan's default limit

For each chain shape and length n, at budgets 25 %, 50 % and 75 % of the way from
the `full` peak to the `none` peak, time the fast solver
(`lightning_ckpt.planning.chain_planner.solve_chain`, exact unless `--time-limit` gives
it one) and, where it can run in reasonable time, the original forward DP with its
budget-bisection tie-break (`reference_optimal_segments` of tests/oracles.py, in a
subprocess given up after `--old-timeout` seconds); both answers must agree on
(recompute, predicted peak) when the solver is exact. `exact` says whether the solver
finished; `gap` is how far above the optimum its plan can be (proven; 0 when exact).
Times are wall-clock seconds, best of `--repeat` runs (planning is deterministic;
the best run is the one least disturbed by other load on the machine; runs over
5 s are not repeated), with the process CPU time of that run beside it: the
solver is single-threaded, so on a shared machine CPU time is what an idle core
would take.

Shapes:
- `uniform`: `uniform(n)` of tests/test_policies.py (10 MiB saved, 0.5 MiB boundary).
- `encoder`: the 48-block text encoder of examples/train_encoder.py profiled at batch
  16 (every block identical), its block costs repeated to n blocks and its parameter
  memory scaled with n. The profile recorded below is used unless `--profile`
  re-measures it (about a minute on CPU).
- `stages`: ResNet-like, from the encoder block: 4 stages of n/4 blocks, the
  activation bytes halving and the parameters quadrupling from stage to stage.
- `encoder~5%`: the encoder with every byte and FLOP count of every block jittered by
  up to +-5 % (seeded with n; `--seeds 0 1 2` adds other draws as rows `encoder~5%/1`,
  ...): no two blocks tie, bytes and FLOPs stay correlated (what measured `ms` costs
  look like). The hard case: see `chain_planner`'s "Cost".
- `random`: `random_cost(random.Random(n), n)` of tests/test_policies.py, the
  adversarial heterogeneous chains of the brute-force tests (bytes and FLOPs drawn
  independently per block, 10 % unchainable blocks).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from oracles import reference_optimal_segments  # noqa: E402  (tests/oracles.py)

from lightning_ckpt.planning.chain_planner import solve_chain  # noqa: E402
from lightning_ckpt.costs.block_costs import BlockCost, StepCost  # noqa: E402
from lightning_ckpt.planning.memory_model import predict_peak  # noqa: E402
from lightning_ckpt.planning.segment_shapes import every_k_segments  # noqa: E402
from lightning_ckpt.planning.recompute_cost import recompute_cost  # noqa: E402

# examples/train_encoder.py, EncoderClassifier(), batch 16, AdamW after one step:
# profile_model(..., probe batches (1, 2), check at 4).at(16). Every block measured the same.
ENCODER_BLOCK = dict(
    saved_bytes=31490048,
    input_bytes=1048576,
    input_saved_bytes=1048576,
    output_bytes=1048576,
    fwd_transient_bytes=1048576,
    bwd_transient_bytes=4456960,
    grad_bytes=793088,
    fwd_flops=939524096,
    tail_flops=0,
)
ENCODER_STEP = dict(
    batch_size=16,
    static_bytes=115199304,
    outside_grad_bytes=330768,
    pre_saved_bytes=1048576,
    post_saved_bytes=3165208,
    grads_live_in_forward=True,
    optimizer_transient_bytes=524288,
)


def _uniform(n: int) -> StepCost:
    from test_policies import uniform

    return uniform(n)


def _random(n: int) -> StepCost:
    from test_policies import random_cost

    return random_cost(random.Random(n), n)


def encoder_profile(live: bool) -> StepCost:
    if not live:
        blocks = tuple(BlockCost(f"block{i}", **ENCODER_BLOCK) for i in range(48))
        return StepCost(blocks=blocks, **ENCODER_STEP)
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from train_encoder import EncoderClassifier, SyntheticTextDataModule

    from lightning_ckpt import profile_model, static_memory

    torch.manual_seed(0)
    model = EncoderClassifier()
    data = SyntheticTextDataModule(batch_size=16)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_fn(b):
        x, y = b
        return torch.nn.functional.cross_entropy(model(x), y)

    loss_fn(batch).backward()
    opt.step()
    profile = profile_model(model, list(model.blocks), loss_fn, batch, (1, 2), 4)
    static = static_memory(model, [opt])
    return profile.at(16, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes)


def scaled(base: StepCost, n: int, jitter: float = 0.0, seed: int = 0) -> StepCost:
    """`base`'s blocks repeated to n blocks; parameter memory scales with the blocks."""
    rng = random.Random(seed)
    k = base.n_blocks
    # the blocks' parameters and AdamW state (3x their gradient bytes) grow with n; the rest stays
    block_static = [3 * b.grad_bytes for b in base.blocks]
    rest = max(0, base.static_bytes - sum(block_static))
    blocks = []
    for i in range(n):
        b = base.blocks[i % k]
        fields = {"name": f"block{i}"}
        if jitter:
            for f in ("saved_bytes", "input_bytes", "output_bytes", "fwd_transient_bytes", "bwd_transient_bytes", "grad_bytes", "fwd_flops"):
                fields[f] = int(getattr(b, f) * (1 + rng.uniform(-jitter, jitter)))
            fields["input_saved_bytes"] = fields["input_bytes"] if b.input_saved_bytes else 0
            fields["saved_bytes"] = max(fields["saved_bytes"], fields["input_saved_bytes"])
        blocks.append(dataclasses.replace(b, **fields))
    static = rest + sum(block_static[i % k] for i in range(n))
    return dataclasses.replace(base, blocks=tuple(blocks), static_bytes=static, meta={})


def stages(base: StepCost, n: int) -> StepCost:
    """A ResNet-like chain from one encoder block: 4 stages of n/4 blocks; per stage the
    activation bytes halve and the parameters quadruple, the FLOPs stay the same."""
    b0 = base.blocks[0]
    byte_fields = ("saved_bytes", "input_bytes", "input_saved_bytes", "output_bytes", "fwd_transient_bytes", "bwd_transient_bytes")
    blocks = []
    for i in range(n):
        s = min(3, 4 * i // n)
        fields = {f: getattr(b0, f) >> s for f in byte_fields}
        blocks.append(dataclasses.replace(b0, name=f"block{i}", grad_bytes=(b0.grad_bytes << (2 * s)) // 4, **fields))
    static = sum(3 * b.grad_bytes for b in blocks)
    return dataclasses.replace(base, blocks=tuple(blocks), static_bytes=static, meta={})


def budgets(cost: StepCost, fracs) -> list[tuple[float, int]]:
    n = cost.n_blocks
    full = predict_peak(cost, every_k_segments(n, 1)).peak_bytes
    none = predict_peak(cost, []).peak_bytes
    return [(f, int(full + f * (none - full))) for f in fracs]


def timed(fn, repeat: int):
    best = None
    for i in range(repeat):
        if best is not None and best[0] > 5.0:
            break  # slow cases run once
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if best is None or wall < best[0]:
            best = (wall, cpu, out)
    return best


def _old_child(conn, cost, budget):
    t0 = time.perf_counter()
    segs = reference_optimal_segments(cost, budget)
    conn.send((time.perf_counter() - t0, segs))


def old_dp(cost: StepCost, budget: int, timeout: float):
    """(seconds, segments) of the original DP, or None when it runs past `timeout` (killed)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_old_child, args=(child, cost, budget))
    proc.start()
    try:
        if parent.poll(timeout):
            return parent.recv()
        return None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[48, 100, 200, 500, 1000])
    ap.add_argument("--shapes", nargs="+", default=["uniform", "encoder", "stages", "encoder~5%", "random"])
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--old-max-n", type=int, default=100, help="run the original DP up to this n")
    ap.add_argument("--old-timeout", type=float, default=30.0, help="seconds before the original DP is given up")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="re-profile the encoder instead of the recorded profile")
    ap.add_argument("--time-limit", type=float, default=None, help="the solver's time_limit_s (default: none, exact)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="jitters of encoder~5%% (s > 0: row encoder~5%%/s)")
    args = ap.parse_args()

    enc = encoder_profile(args.profile)
    makers = {
        "uniform": _uniform,
        "encoder": lambda n: scaled(enc, n),
        "stages": lambda n: stages(enc, n),
        "random": _random,
    }
    for s in args.seeds:  # seed 0 draws with seed n, seed s with 1000 * s + n
        makers["encoder~5%" + (f"/{s}" if s else "")] = lambda n, s=s: scaled(enc, n, jitter=0.05, seed=1000 * s + n)
    shapes = [k for shape in args.shapes for k in makers if k == shape or k.startswith(shape + "/")]
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    print(f"# python {sys.version.split()[0]}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, load average {load}")
    head = (
        f"{'n':>5} {'shape':<13} {'budget':>6} {'new s':>8} {'new cpu':>8} {'exact':>5} {'gap':>7} "
        f"{'old s':>8} {'old/new':>8} {'recompute':>10} {'segs':>5}"
    )
    print(head)
    print("-" * len(head))
    worst = {}
    for n in args.sizes:
        for shape in shapes:
            cost = makers[shape](n)
            for frac, budget in budgets(cost, args.fracs):
                wall, cpu, sol = timed(lambda: solve_chain(cost, budget, time_limit_s=args.time_limit), args.repeat)
                segs = sol.segments
                key = (recompute_cost(cost, segs), predict_peak(cost, segs).peak_bytes)
                assert key[1] <= budget and key == (sol.cost, sol.peak_bytes)
                exact = sol.lower_bound is None
                share = key[0] / max(1, sum(b.fwd_flops for b in cost.blocks))
                old = ""
                ratio = ""
                if n <= args.old_max_n:
                    res = old_dp(cost, budget, args.old_timeout)
                    if res is None:
                        old, ratio = f">{args.old_timeout:.0f}", f">{args.old_timeout / wall:.0f}x"
                    else:
                        owall, oseg = res
                        okey = (recompute_cost(cost, oseg), predict_peak(cost, oseg).peak_bytes)
                        assert okey == key or (not exact and okey[0] >= sol.lower_bound), (n, shape, frac, okey, key)
                        old, ratio = f"{owall:8.3f}", f"{owall / wall:7.0f}x"
                print(
                    f"{n:>5} {shape:<13} {frac:>6.0%} {wall:8.3f} {cpu:8.3f} {'yes' if exact else 'no':>5} {sol.gap:>7.3%} "
                    f"{old:>8} {ratio:>8} {share:>9.1%} {len(segs):>5}",
                    flush=True,
                )
                worst[(n, shape)] = max(worst.get((n, shape), 0.0), wall)
    print()
    for n in args.sizes:
        if n >= 1000:
            line = ", ".join(f"{s} {worst[(n, s)]:.2f} s" for s in shapes)
            print(f"slowest of the budgets at n = {n}: {line}")


if __name__ == "__main__":
    main()
