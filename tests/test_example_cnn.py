"""The CNN example (examples/train_cnn.py): it learns, its plans are predicted right,
BatchNorm statistics survive checkpointing bit for bit, and the planner spends its
recompute on the high-resolution stages."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "cnn.yaml"
if str(ROOT) not in sys.path:  # the config names the classes as examples.train_cnn.*
    sys.path.insert(0, str(ROOT))

from examples import train_cnn as ex  # noqa: E402
from lightning_ckpt import (  # noqa: E402
    make_plan,
    measure_step_peak,
    profile_model,
    resolve_blocks,
    static_memory,
)
from lightning_ckpt.apply.segments import apply_segments  # noqa: E402
from lightning_ckpt.costs.machine_rates import MachineRates  # noqa: E402

CHAIN = ["stem", "layer1.*", "layer2.*", "layer3.*", "layer4.*"]
TARGET = 32  # small enough that a tracked step takes a fraction of a second
FRACTIONS = (0.25, 0.50, 0.75)  # budgets this far from the `full` peak to the `none` peak
RESOLUTION = {"stem": 32, "layer1": 32, "layer2": 16, "layer3": 8, "layer4": 4}
# The `time` metric's rates, fixed (what `profile_model` measured with timing on, on the 2-core
# CPU the suite runs on, rounded) and the profile untimed, without keep calibration: op-level
# plans then come out the same on every machine.
RATES = MachineRates(
    flop_per_s=1.0e11, mem_byte_per_s=1.32e10, rng_byte_per_s=8.8e8, segment_s=2.3e-5,
    keep_draws_op_s=1.6e-5, keep_ops_op_s=3.5e-5,
)


def _resolution(name: str) -> int:
    return RESOLUTION[name.split(".")[0]]


def _budgets(cost) -> dict[float, int]:
    none = make_plan(cost, "none").predicted_peak_bytes
    full = make_plan(cost, "full").predicted_peak_bytes
    assert full < none
    return {f: int(full + f * (none - full)) for f in FRACTIONS}


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    model = ex.ShapesResNet()
    data = ex.ShapesDataModule(batch_size=TARGET, n_train=4 * TARGET, n_val=TARGET)
    data.setup("fit")
    batches = list(data.train_dataloader())[:3]
    opt = model.configure_optimizers()

    def loss_fn(b):
        x, y = b
        return F.cross_entropy(model(x), y)

    # one real step first: gradients and AdamW state exist, as in steady-state training
    loss_fn(batches[0]).backward()
    opt.step()
    names, blocks = resolve_blocks(model, CHAIN)[1:]
    profile = profile_model(model, blocks, loss_fn, batches[0], (1, 2), 4, names=names, timing=False, rates=RATES)
    static = static_memory(model, [opt])
    cost = profile.at(TARGET, static_bytes=static.resident_bytes, optimizer_transient_bytes=static.optimizer_transient_bytes)
    return model, opt, batches, loss_fn, names, blocks, profile, cost


# ----------------------------------------------------------------------------- the example


def test_chain_is_stem_and_four_stages_of_falling_resolution():
    model = ex.ShapesResNet()
    _, names, blocks = resolve_blocks(model, CHAIN)
    assert names == ["stem", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0", "layer4.1"]
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, out, n=n: seen.append((n, tuple(out.shape[1:])))) for n, b in zip(names, blocks)]
    model(torch.zeros(2, 3, 32, 32))
    for h in hooks:
        h.remove()
    assert [n for n, _ in seen] == names  # called in the listed order
    assert [s for _, s in seen] == [(16, 32, 32)] * 3 + [(32, 16, 16)] * 2 + [(64, 8, 8)] * 2 + [(128, 4, 4)] * 2
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) >= 2 * len(blocks)


def test_data_is_deterministic_balanced_and_batch_size_is_read_on_reload():
    a = ex.ShapesDataModule(batch_size=8, n_train=256, n_val=32)
    b = ex.ShapesDataModule(batch_size=8, n_train=256, n_val=32)
    a.setup("fit")
    b.setup("fit")
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])
    assert torch.bincount(a.train_set.tensors[1], minlength=4).min() > 256 / 4 * 0.7
    assert next(iter(a.train_dataloader()))[0].shape == (8, 3, 32, 32)
    a.batch_size = 5  # what the callback does through lightning_setattr
    assert next(iter(a.train_dataloader()))[0].shape == (5, 3, 32, 32)


def _tiny_config(tmp_path: Path, **callback) -> Path:
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["seed_everything"] = 0
    cfg["trainer"].update(
        max_steps=80, val_check_interval=80, limit_val_batches=8, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    cb = cfg["trainer"]["callbacks"][0]["init_args"]
    cb.update(target_batch_size=32, report=False, verbose=False, **callback)
    cfg["model"]["init_args"].update(width=8, lr=3e-3)  # a quarter of the FLOPs; learns as fast at this rate
    cfg["data"]["init_args"].update(batch_size=32, n_train=80 * 32, n_val=256)
    path = tmp_path / "cnn_tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_tiny_config_learns_above_chance_with_every_block_checkpointed(tmp_path, monkeypatch):
    """80 steps through LightningCLI with the config's callback (policy full): val accuracy well above 25 %."""
    monkeypatch.setattr(sys, "argv", ["train_cnn.py"])
    config = _tiny_config(tmp_path, policy="full", memory_budget="1GiB")
    cli = ex.main(["fit", "--config", str(config)])
    callback = next(c for c in cli.trainer.callbacks if type(c).__name__ == "ActivationCheckpointing")
    assert len(callback.plan.checkpointed) == 9
    assert cli.trainer.global_step == 80
    val_acc = float(cli.trainer.callback_metrics["val_acc"])
    assert val_acc > 0.25 + 0.25, f"val_acc {val_acc:.3f} vs chance 0.25"


def test_config_plan_checkpoints_the_32x32_blocks_only(tmp_path, monkeypatch, capsys):
    """`python -m lightning_ckpt plan --config configs/cnn.yaml`: some blocks, all at 32x32."""
    import json

    from lightning_ckpt.__main__ import main as preview

    monkeypatch.chdir(tmp_path)  # the preview writes its report under the config's log dir
    monkeypatch.setattr(sys, "argv", ["lightning_ckpt"])
    rc = preview(["plan", "--config", str(CONFIG), "--data.init_args.n_train=256", "--data.init_args.n_val=64"])
    assert rc == 0
    out = capsys.readouterr().out
    report = next(Path(line.split()[-1]) for line in out.splitlines() if line.startswith("wrote") and line.endswith(".json"))
    plan = json.loads(report.read_text())["plan"]
    assert plan["batch_size"] == 64 and plan["fits"]
    names = [r["name"] for r in plan["rows"]]
    chosen = [names[i] for i in plan["checkpointed"]]
    assert 0 < len(chosen) < len(names)
    assert all(_resolution(n) == 32 for n in chosen), chosen


# ----------------------------------------------------------------------------- predicted vs measured


def _measure(model, opt, batch, loss_fn, blocks, segments) -> int:
    handle = apply_segments(blocks, segments)
    try:
        return measure_step_peak(model, loss_fn, batch, opt)
    finally:
        handle.remove()


def test_profile_line_checks_out(cnn):
    profile = cnn[6]
    assert profile.check_error() < 0.02


def test_every_policy_within_10_percent_and_none_full_optimal_within_3_percent(cnn):
    model, opt, batches, loss_fn, names, blocks, _, cost = cnn
    plans = {}
    for f, budget in _budgets(cost).items():
        for policy in ("none", "full", "every_k", "sqrt", "greedy", "optimal"):
            plans[(f, policy)] = make_plan(cost, policy, budget)
    measured: dict[tuple, int] = {}
    errors = {}
    for key, plan in plans.items():
        segs = plan.segments
        if segs not in measured:
            measured[segs] = _measure(model, opt, batches[0], loss_fn, blocks, segs)
        errors[key] = (plan.predicted_peak_bytes - measured[segs]) / measured[segs]
    assert len(measured) >= 5  # the budgets really give different plans
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert abs(errors[worst]) < 0.10, {k: f"{100 * e:+.1f}%" for k, e in errors.items()}
    whole_step = {k: e for k, e in errors.items() if k[1] in ("none", "full", "optimal")}
    assert max(map(abs, whole_step.values())) < 0.03, {k: f"{100 * e:+.1f}%" for k, e in whole_step.items()}
    for f in FRACTIONS:
        optimal = plans[(f, "optimal")]
        assert optimal.fits and measured[optimal.segments] <= optimal.budget_bytes, (f, optimal.segments)


# ----------------------------------------------------------------------------- BatchNorm


def _train(model, batches, blocks=None, segments=(), guard=True) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = apply_segments(blocks, segments, guard_batchnorm=guard) if segments else None
    losses = []
    try:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    finally:
        if handle is not None:
            handle.remove()
    return losses


def _norm_buffers(model) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")}


def test_batchnorm_statistics_bit_identical_after_three_steps_with_the_optimal_plan(cnn):
    *_, names, _, _, cost = cnn
    batches = cnn[2]
    plan = make_plan(cost, "optimal", _budgets(cost)[0.25])
    assert 0 < len(plan.checkpointed) < len(names)
    torch.manual_seed(1)
    plain = ex.ShapesResNet()
    ckpt = copy.deepcopy(plain)
    ckpt_blocks = resolve_blocks(ckpt, CHAIN)[2]
    # profiling the checkpointed copy first must leave no trace either
    profile_model(ckpt, ckpt_blocks, lambda b: F.cross_entropy(ckpt(b[0]), b[1]), batches[0], (1, 2), None, timing=False)

    losses_plain = _train(plain, batches)
    losses_ckpt = _train(ckpt, batches, ckpt_blocks, plan.segments)

    assert torch.equal(torch.stack(losses_plain), torch.stack(losses_ckpt))
    ref, got = _norm_buffers(plain), _norm_buffers(ckpt)
    assert len(ref) == 3 * sum(isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules())
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert all(int(v) == 3 for n, v in got.items() if n.endswith("num_batches_tracked"))
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(p, q), n


def test_op_level_plans_fit_predicted_within_5_percent_and_keep_batchnorm_exact(cnn):
    """granularity='op' at every budget: measured within the budget and 5 % of the prediction;
    three steps with the 25 % plan leave losses, parameters and BatchNorm buffers bit-identical."""
    model, opt, batches, loss_fn, names, blocks, _, cost = cnn
    plans = {f: make_plan(cost, "optimal", b, metric="time", granularity="op") for f, b in _budgets(cost).items()}
    assert any(p.keeps for p in plans.values())
    for f, plan in plans.items():
        handle = apply_segments(blocks, plan.segments, keep_ops=plan.keep_ops, inner_segments=plan.inner_segments)
        try:
            measured = measure_step_peak(model, loss_fn, batches[0], opt)
        finally:
            handle.remove()
        assert measured <= plan.budget_bytes, (f, measured, plan.budget_bytes)
        assert abs(plan.predicted_peak_bytes - measured) / measured < 0.05, (f, plan.predicted_peak_bytes, measured)
    plan = next(p for p in plans.values() if p.keeps)
    torch.manual_seed(1)
    plain = ex.ShapesResNet()
    ckpt = copy.deepcopy(plain)
    ckpt_blocks = resolve_blocks(ckpt, CHAIN)[2]
    handle = apply_segments(ckpt_blocks, plan.segments, keep_ops=plan.keep_ops, inner_segments=plan.inner_segments)
    try:
        losses_ckpt = _train(ckpt, batches)
    finally:
        handle.remove()
    assert torch.equal(torch.stack(_train(plain, batches)), torch.stack(losses_ckpt))
    ref, got = _norm_buffers(plain), _norm_buffers(ckpt)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(p, q), n


def test_without_the_guard_the_recompute_updates_batchnorm_twice(cnn):
    """The control for the test above: it would notice a double update."""
    *_, cost = cnn
    batches = cnn[2]
    plan = make_plan(cost, "optimal", _budgets(cost)[0.25])
    torch.manual_seed(1)
    plain = ex.ShapesResNet()
    ckpt = copy.deepcopy(plain)
    _train(plain, batches)
    _train(ckpt, batches, resolve_blocks(ckpt, CHAIN)[2], plan.segments, guard=False)
    first = plan.rows[plan.checkpointed[0]].name
    key = f"{first}.1.num_batches_tracked" if first == "stem" else f"{first}.bn1.num_batches_tracked"
    assert int(_norm_buffers(plain)[key]) == 3 and int(_norm_buffers(ckpt)[key]) == 6


# ----------------------------------------------------------------------------- where the recompute goes


def test_optimal_checkpoints_high_resolution_stages_first(cnn):
    *_, names, _, _, cost = cnn
    none = make_plan(cost, "none").predicted_peak_bytes
    full = make_plan(cost, "full").predicted_peak_bytes
    # At the `full` peak itself (f = 0) the plan must match full's memory, and the model
    # finds the 0.3 MiB it needs there only by also rebuilding an 8x8 block: a legitimate
    # corner, checked for fit and cost only.
    tightest = make_plan(cost, "optimal", full)
    assert tightest.predicted_peak_bytes <= full
    assert tightest.recompute_flops < make_plan(cost, "full").recompute_flops
    fractions = sorted(set(FRACTIONS) | {k / 20 for k in range(1, 20)})
    chosen_sets = []
    for f in fractions:
        plan = make_plan(cost, "optimal", int(full + f * (none - full)))
        chosen = [names[i] for i in plan.checkpointed]
        assert chosen, f"budget at {f:.2f} forces checkpointing"
        # (The stem is not always taken: checkpointed alone it frees only its conv
        # output, since its ReLU output stays saved by layer1.0's first conv; at some
        # budgets a 16x16 block frees more per FLOP.)
        # the 8x8 and 4x4 stages hold little: never worth their recompute at any of these budgets
        assert all(_resolution(n) >= 16 for n in chosen), (f, chosen)
        chosen_sets.append((f, chosen))
    # at the loosest budgets only 32x32 blocks are checkpointed
    assert all(_resolution(n) == 32 for n in chosen_sets[-1][1]), chosen_sets[-1]
    # and checkpointing 32x32 blocks saves more bytes per recomputed FLOP than 16x16, 8x8, 4x4 ones
    per_flop = {}
    for b in cost.blocks:
        per_flop.setdefault(_resolution(b.name), []).append((b.saved_bytes - b.input_bytes) / b.fwd_flops)
    order = [sum(v) / len(v) for _, v in sorted(per_flop.items(), reverse=True)]
    assert order == sorted(order, reverse=True), per_flop
