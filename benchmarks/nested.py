"""Multi-level plans on the 48-block encoder: below `full`'s peak, and the batch they buy.

    OMP_NUM_THREADS=1 python benchmarks/nested.py           # the encoder of configs/encoder48.yaml
    OMP_NUM_THREADS=1 python benchmarks/nested.py --quick   # 12 small blocks, for a smoke run

Profiles the encoder once (batch 16, AdamW state allocated), then:

1. Below `full`. The step's floor is what it holds with no activations at all
   (parameters, optimizer state, the batch and the gradients). At the budget whose part
   above the floor is 60 % of `full`'s, no single-level plan fits; the multi-level plan is
   made, applied, and its step measured by the live-storage tracker against its
   prediction. Its loss and every gradient are compared bit for bit with a step without
   checkpointing from the same seed (fp32, dropout 0.1).
2. The batch it buys. At `full`'s predicted peak at batch 16 (the budget where `full`
   fits batch 16), the largest batch of `full`, of single-level `optimal` and of
   multi-level `optimal` (2 and 3 levels), each searched by `largest_batch` on the
   fitted profile; the multi-level plan at its largest batch is applied and measured.
Also prints the planning time of each multi-level plan and its plan table's nesting lines.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_ckpt import make_plan, measure_step_peak, profile_model, static_memory  # noqa: E402
from lightning_ckpt.apply.segments import apply_segments  # noqa: E402
from lightning_ckpt.planning.capacity import largest_batch  # noqa: E402
from lightning_ckpt.planning.nested_model import depth_of  # noqa: E402
from lightning_ckpt.units import format_bytes  # noqa: E402


def encoder(quick: bool, rows: int):
    from train_encoder import EncoderClassifier, SyntheticTextDataModule

    torch.manual_seed(0)
    if quick:
        model, seq = EncoderClassifier(n_blocks=12, d_model=64, seq_len=64), 64
    else:
        model, seq = EncoderClassifier(), 128  # configs/encoder48.yaml
    data = SyntheticTextDataModule(batch_size=rows, seq_len=seq, n_train=rows, n_val=rows)
    data.setup("fit")
    return model, next(iter(data.train_dataloader()))


def take(batch, n: int):
    return tuple(t[:n] for t in batch)


def grads_and_loss(model, loss_fn, batch, seed: int):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(batch)
    loss.backward()
    out = [loss.detach().clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def measured(model, blocks, loss_fn, batch, opt, plan) -> int:
    handle = apply_segments(blocks, plan.segments, inner_segments=plan.inner_segments)
    try:
        return measure_step_peak(model, loss_fn, batch, opt)
    finally:
        handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="12 small blocks instead of the 48-block encoder")
    args = parser.parse_args()
    B = 16
    model, data = encoder(args.quick, 4 * B)
    blocks = list(model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_fn(b):
        x, y = b
        return F.cross_entropy(model(x), y)

    batch = take(data, B)
    loss_fn(batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    profile = profile_model(model, blocks, loss_fn, batch, (1, 2), 4, calibrate_keeps=False)  # block-level plans only
    static = static_memory(model, [opt])

    def cost_at(b: int):
        return profile.at(b, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes)

    cost = cost_at(B)
    full = make_plan(cost, "full")
    floor = cost.static_bytes + cost.batch_bytes + cost.grad_bytes
    print(f"encoder: {len(blocks)} blocks, batch {B}; floor {format_bytes(floor)} "
          f"(parameters, optimizer state, batch, gradients); full peak {format_bytes(full.predicted_peak_bytes)}")

    # 1. below full
    budget = int(floor + 0.6 * (full.predicted_peak_bytes - floor))
    print(f"\n1. budget {format_bytes(budget)}: 60 % of full's {format_bytes(full.predicted_peak_bytes - floor)} above the floor")
    single = None
    try:
        single = make_plan(cost, "optimal", budget, max_levels=1)
    except ValueError as err:
        print(f"   single-level optimal: none fits ({str(err)[:80]}...)")
    if single is not None:
        print(f"   single-level optimal: fits, predicted {format_bytes(single.predicted_peak_bytes)}")
    print(f"   {'levels':>6} {'plan s':>7} {'segs':>5} {'inner':>6} {'depth':>6} {'predicted':>11} {'measured':>11} "
          f"{'pred/meas':>9} {'fits':>5} {'recompute':>10} {'bit-identical':>14}")
    for levels in (2, 3):
        t0 = time.perf_counter()
        try:
            plan = make_plan(cost, "optimal", budget, max_levels=levels)
        except ValueError as err:
            print(f"   {levels:>6}: no plan fits ({str(err)[:100]}...)")
            continue
        dt = time.perf_counter() - t0
        peak = measured(model, blocks, loss_fn, batch, opt, plan)
        ref = grads_and_loss(model, loss_fn, batch, seed=7)
        handle = apply_segments(blocks, plan.segments, inner_segments=plan.inner_segments)
        try:
            got = grads_and_loss(model, loss_fn, batch, seed=7)
        finally:
            handle.remove()
        same = len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
        print(f"   {levels:>6} {dt:>7.2f} {len(plan.segments):>5} {len(plan.inner_segments):>6} "
              f"{depth_of(plan.segments, plan.inner_segments):>6} {format_bytes(plan.predicted_peak_bytes):>11} "
              f"{format_bytes(peak):>11} {plan.predicted_peak_bytes / peak:>9.3f} {str(peak <= budget):>5} "
              f"{100 * plan.recompute_share:>9.1f}% {str(same):>14}")
        if levels == 2:
            nesting = [line for line in str(plan).splitlines() if line.startswith("  seg ")]
            print("   nesting of the 2-level plan (first 4 segments):")
            for line in nesting[:4]:
                print("     " + line.strip())

    # 2. the batch it buys
    budget = full.predicted_peak_bytes
    print(f"\n2. budget {format_bytes(budget)}: full's predicted peak at batch {B}")
    rows = []
    for label, policy, levels in (("full", "full", 1), ("optimal, 1 level", "optimal", 1),
                                  ("optimal, 2 levels", "optimal", 2), ("optimal, 3 levels", "optimal", 3)):
        t0 = time.perf_counter()
        best, plan = largest_batch(cost_at, budget, policy, max_levels=levels)
        rows.append((label, best, plan, time.perf_counter() - t0))
    print(f"   {'plan':<18} {'largest batch':>13} {'x full':>7} {'search s':>9} {'depth':>6}")
    base = rows[0][1]
    for label, best, plan, dt in rows:
        print(f"   {label:<18} {best:>13} {best / base:>7.2f} {dt:>9.1f} {depth_of(plan.segments, plan.inner_segments):>6}")
    for label, best, plan, _ in rows[2:]:
        if best > data[0].shape[0]:
            print(f"   {label}: batch {best} is more than the {data[0].shape[0]} rows built; not measured")
            continue
        peak = measured(model, blocks, loss_fn, take(data, best), opt, plan)
        print(f"   {label} at batch {best}: predicted {format_bytes(plan.predicted_peak_bytes)}, measured "
              f"{format_bytes(peak)} (pred/meas {plan.predicted_peak_bytes / peak:.3f}), within the budget: {peak <= budget}")


if __name__ == "__main__":
    main()
