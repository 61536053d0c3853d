"""Plans of the two examples, written to (or checked against) a JSON snapshot.

    OMP_NUM_THREADS=1 python benchmarks/plan_snapshot.py --write tests/data/plan_snapshot.json
    OMP_NUM_THREADS=1 python benchmarks/plan_snapshot.py --check tests/data/plan_snapshot.json

`--write` profiles the encoder (configs/encoder48.yaml: 48 blocks, batch 16) and the
CNN (configs/cnn.yaml: stem + 8 blocks, batch 64), stores each `StepCost` and, for
every policy, both cost metrics and nine budgets from the `full` peak to the `none`
peak, the planned segments, predicted peak and peak phase. `--check` profiles again
(with the stored machine rates, so the `time` metric sees the same rates), compares
the byte and FLOP counts of the new profile with the stored one, re-plans from the
stored costs and from the new ones, and prints every difference (exit 1 if any).
`tests/test_plan_snapshot.py` re-plans from the stored costs in the test suite.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]

from _examples import CNN_CHAIN, cnn_example, encoder_example  # noqa: E402

import lightning_ckpt as lc  # noqa: E402

FRACTIONS = [k / 10 for k in range(1, 10)]
POLICIES = [("none", None), ("full", None), ("sqrt", None), ("every_k", 4), ("every_k", None), ("greedy", None), ("optimal", None)]
METRICS = ("flops", "time")
# counts that do not depend on timing: the profile must reproduce them exactly
EXACT_FIELDS = (
    "saved_bytes", "input_bytes", "input_saved_bytes", "shared_with_previous_bytes", "input_saved_by_previous_bytes",
    "output_bytes", "output_saved_bytes", "fwd_transient_bytes", "ckpt_fwd_peak_bytes", "bwd_transient_bytes",
    "grad_bytes", "fwd_flops", "tail_flops", "fwd_mem_bytes", "tail_mem_bytes", "fwd_rng_bytes", "tail_rng_bytes",
)


def _cost(name: str, rates=None):
    if name == "encoder":
        model, batch, bs = encoder_example(quick=False)
        blocks = list(model.blocks)
        names = None
    else:
        model, batch, bs = cnn_example(quick=False)
        _, names, blocks = lc.resolve_blocks(model, CNN_CHAIN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_fn(b):
        x, y = b
        return torch.nn.functional.cross_entropy(model(x), y)

    loss_fn(batch).backward()  # one real step: gradients and AdamW state exist
    opt.step()
    # block-level plans only: no op-level options to calibrate
    profile = lc.profile_model(model, blocks, loss_fn, batch, (1, 2), 4, names=names, rates=rates, calibrate_keeps=False)
    static = lc.static_memory(model, [opt])
    return profile.at(bs, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes)


def plans_of(cost) -> list[dict]:
    """Every (policy, metric, budget) plan of `cost`, as plain data."""
    lo = lc.make_plan(cost, "full").predicted_peak_bytes
    hi = lc.make_plan(cost, "none").predicted_peak_bytes
    out = []
    for f in FRACTIONS:
        budget = int(lo + f * (hi - lo))
        for metric in METRICS:
            for policy, k in POLICIES:
                try:
                    plan = lc.make_plan(cost, policy, budget, every_k=k, metric=metric)
                    row = {"segments": [list(s) for s in plan.segments], "peak": plan.predicted_peak_bytes,
                           "phase": plan.peak_phase}
                except lc.InfeasibleBudgetError:
                    row = {"infeasible": True}
                out.append({"fraction": f, "budget": budget, "metric": metric, "policy": policy, "k": k, **row})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path)
    mode.add_argument("--check", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.write:
        data = {}
        for name in ("encoder", "cnn"):
            cost = _cost(name)
            data[name] = {"cost": cost.to_dict(), "plans": plans_of(cost)}
        args.write.write_text(json.dumps(data, indent=1))
        print(f"wrote {args.write}: {sum(len(v['plans']) for v in data.values())} plans")
        return 0
    data = json.loads(args.check.read_text())
    problems = 0
    for name, entry in data.items():
        stored = lc.StepCost.from_dict(entry["cost"])
        fresh = _cost(name, rates=stored.rates)
        for old, new in zip(stored.blocks, fresh.blocks):
            for f in EXACT_FIELDS:
                if getattr(old, f) != getattr(new, f):
                    problems += 1
                    print(f"{name} {old.name}.{f}: stored {getattr(old, f)}, profiled now {getattr(new, f)}")
        for label, cost in (("stored cost", stored), ("profiled now", fresh)):
            again = plans_of(cost)
            same = sum(a == b for a, b in zip(again, entry["plans"]))
            print(f"{name}, {label}: {same}/{len(entry['plans'])} plans identical (segments, predicted peak, phase)")
            problems += len(entry["plans"]) - same
            for a, b in zip(again, entry["plans"]):
                if a != b:
                    print(f"  now {a}\n  was {b}")
    print("no difference" if not problems else f"{problems} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
