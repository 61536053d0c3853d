"""The plan under `torch.compile`: still one compiled graph, no graph break, the same losses.

Small models and few steps (every compile costs seconds on CPU); marked `slow`.
"""

from __future__ import annotations

import copy
import pickle
import tempfile
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.apply.segments import apply_segments
from lightning_ckpt.apply.compiled import apply_compiled_segments, compiled_modules

pytestmark = pytest.mark.slow
STEPS = 5


class Block(nn.Module):
    def __init__(self, d: int, p: float = 0.0, bn: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.bn = nn.BatchNorm1d(2 * d) if bn else nn.Identity()
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.bn(self.fc1(x)))))


class Net(nn.Module):
    """Eight residual MLP blocks and a head."""

    def __init__(self, d: int = 32, n: int = 8, p: float = 0.0, bn: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p, bn) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


class Recorder:
    """A dynamo backend that keeps each graph and compiles it with inductor."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def regions(self) -> int:
        hop = torch._higher_order_ops.wrap.tag_activation_checkpoint
        return sum(n.target is hop for gm in self.graphs for n in gm.graph.nodes)


def _fresh() -> None:
    torch._dynamo.reset()
    counters.clear()


def _breaks() -> int:
    return sum(counters["graph_break"].values())


# ----------------------------------------------------------------------------- without Lightning


def _train(net: nn.Module, model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the same dropout stream in every run
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _compiled_run(segments, p: float = 0.0, bn: bool = False):
    _fresh()
    torch.manual_seed(0)
    net = Net(p=p, bn=bn)
    handle = apply_compiled_segments(list(net.blocks), segments) if segments else None
    rec = Recorder()
    losses = _train(net, torch.compile(net, backend=rec))
    return net, handle, rec, losses


@pytest.mark.parametrize(("p", "bn"), [(0.0, False), (0.3, False), (0.0, True)])
def test_compiled_regions_one_graph_same_training(p, bn):
    ref_net, _, _, ref_losses = _compiled_run(None, p, bn)
    net, handle, rec, losses = _compiled_run([(0, 2), (5, 5)], p, bn)
    assert handle.segments == [(0, 0), (1, 1), (2, 2), (5, 5)]  # compiled: one block per region
    assert len(rec.graphs) == 1 and _breaks() == 0
    assert rec.regions() == 4
    # dropout under compile: the mask is drawn once in the forward graph and reused by the
    # recompute, so the run equals compiled training without checkpointing
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    ref_state, state = ref_net.state_dict(), net.state_dict()
    for k in ref_state:  # BatchNorm statistics: updated once per step, as without checkpointing
        assert torch.allclose(ref_state[k].float(), state[k].float(), rtol=1e-5, atol=1e-6), k


def test_compiled_region_eager_is_bit_exact_with_dropout_and_batchnorm():
    def run(form):
        torch.manual_seed(0)
        net = Net(p=0.3, bn=True)
        if form is not None:
            form(list(net.blocks), [(0, 0), (3, 4)])
        return _train(net, net), net.state_dict()

    ref_losses, ref_state = run(None)
    for form in (apply_segments, apply_compiled_segments):
        losses, state = run(form)
        assert losses == ref_losses
        assert all(torch.equal(ref_state[k], state[k]) for k in ref_state)


def test_compiled_regions_keep_tree_copy_pickle_and_undo():
    net = Net()
    keys, names = list(net.state_dict()), [n for n, _ in net.named_modules()]
    handle = apply_compiled_segments(list(net.blocks), [(1, 2)])
    assert list(net.state_dict()) == keys and [n for n, _ in net.named_modules()] == names
    twin = copy.deepcopy(net)
    assert twin.blocks[1].forward.module is twin.blocks[1]
    pickle.loads(pickle.dumps(net))
    handle.remove()
    assert "forward" not in net.blocks[1].__dict__ and not handle.active


def test_region_that_runs_eagerly_under_compile_says_so():
    class Breaking(Block):
        def forward(self, x):
            torch._dynamo.graph_break()
            return super().forward(x)

    _fresh()
    net = Net()
    net.blocks[3] = Breaking(32)
    names = [f"blocks.{i}" for i in range(8)]
    apply_compiled_segments(list(net.blocks), [(3, 3)], names=names, warn_eager=True)
    with pytest.warns(UserWarning, match="'blocks.3' ran eagerly although the model is compiled"):
        _train(net, torch.compile(net), steps=1)


def test_compiled_modules_names_what_compiles_the_blocks():
    net = Net()
    outer = nn.Sequential(torch.compile(net))
    assert compiled_modules(outer, list(net.blocks)) == ["0"]
    assert compiled_modules(net, list(net.blocks)) == []


# ----------------------------------------------------------------------------- with Lightning


class LitNet(pl.LightningModule):
    def __init__(self, inner: bool = False, backend: object = "inductor") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.compile(Net(), backend=backend) if inner else Net()
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(pattern: str, policy: str | None, budget: int | None = None, plan_only: bool = False, seen: list | None = None):
    _fresh()
    rec = Recorder()
    module = LitNet(inner=pattern == "inner", backend=rec)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    cb = None
    if policy is not None:
        cb = ActivationCheckpointing(
            8, memory_budget=budget or "1GiB", policy=policy, blocks="net.blocks", verbose=False, report=False,
            plan_only=plan_only,
        )
        if seen is not None:
            seen.append(cb)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=STEPS, callbacks=[cb] if cb else [], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tempfile.mkdtemp(prefix="lckpt-"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a region that ran eagerly fails the test
        warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec|global hooks).*")
        trainer.fit(torch.compile(module, backend=rec) if pattern == "outer" else module, data)
    return module, cb, rec


@pytest.fixture(scope="module")
def forced_budget() -> int:
    """Half way between the predicted peaks of `none` and `full`: `optimal` must checkpoint."""
    from lightning_ckpt.frontends.lightning.callback import PlanOnly

    seen: list = []
    for policy in ("none", "full"):
        with pytest.raises(PlanOnly):
            _fit("eager", policy, plan_only=True, seen=seen)
    none, full = (cb.plan.predicted_peak_bytes for cb in seen)
    assert full < none
    return (none + full) // 2


@pytest.fixture(scope="module")
def reference_losses() -> dict[str, list[float]]:
    return {pattern: _fit(pattern, None)[0].losses for pattern in ("outer", "inner")}


@pytest.mark.parametrize("pattern", ["outer", "inner"])
@pytest.mark.parametrize("policy", ["none", "full", "optimal"])
def test_callback_keeps_compile(pattern, policy, forced_budget, reference_losses):
    module, cb, rec = _fit(pattern, policy, forced_budget if policy == "optimal" else None)
    assert len(rec.graphs) >= 1 and _breaks() == 0, dict(counters["graph_break"])
    n_regions = len(cb.plan.checkpointed)
    assert rec.regions() == n_regions
    assert all(b == a for a, b in cb.plan.segments)
    if policy != "none":
        assert n_regions > 0
    assert len(module.losses) == STEPS
    assert module.losses == pytest.approx(reference_losses[pattern], rel=1e-5)


def test_op_level_keeps_under_compile_are_refused_loudly():
    """A plan that keeps op outputs cannot keep them inside a compiled graph: one warning,
    with the way out, and the blocks are checkpointed whole."""
    from lightning_ckpt.frontends.lightning.compiled import apply_plan
    from lightning_ckpt.planning.plan import Plan

    net = Net()
    outer = nn.Sequential(torch.compile(net))
    plan = Plan(
        policy="optimal", batch_size=4, segments=((0, 0),), predicted_peak_bytes=1, peak_phase="forward",
        budget_bytes=None, static_bytes=0, recompute_flops=0, recompute_ms=0.0, step_flops=0, rows=(),
        granularity="op", keeps=((0, (("aten.addmm.default", 0),)),),
    )
    with pytest.warns(UserWarning, match=r"keeps op outputs in 1 block\(s\).*Use granularity='block' with torch.compile"):
        applied = apply_plan(outer, list(net.blocks), [f"blocks.{i}" for i in range(8)], plan, True)
    assert applied.keep_ops == {}
    applied.remove()


def test_inner_segments_under_compile_are_refused_loudly():
    """A multi-level plan (made before compiling, e.g. resumed) cannot nest regions in a compiled graph:
    one warning with the way out, every block of the segments becomes a one-block region and no inner
    segment is applied; the same plan on the eager blocks keeps its inner segment."""
    from lightning_ckpt.frontends.lightning.compiled import apply_plan
    from lightning_ckpt.planning.plan import Plan

    net = Net()
    names = [f"blocks.{i}" for i in range(8)]
    plan = Plan(
        policy="optimal", batch_size=4, segments=((0, 3),), predicted_peak_bytes=1, peak_phase="forward",
        budget_bytes=None, static_bytes=0, recompute_flops=0, recompute_ms=0.0, step_flops=0, rows=(),
        inner_segments=((1, 2),),
    )
    with pytest.warns(UserWarning, match=r"rebuilds 1 inner segment\(s\) inside the recompute of larger segments, but "
                      r"the model is compiled \(0\): .*nesting is not applied.*Plan again for the compiled model"):
        applied = apply_plan(nn.Sequential(torch.compile(net)), list(net.blocks), names, plan, True)
    assert applied.segments == [(0, 0), (1, 1), (2, 2), (3, 3)] and applied.inner_segments == []
    applied.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        eager = apply_plan(nn.Sequential(net), list(net.blocks), names, plan, True)
    assert eager.segments == [(0, 3)] and eager.inner_segments == [(1, 2)]
    eager.remove()
