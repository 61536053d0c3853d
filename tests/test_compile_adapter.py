"""torch.compile with `activation_memory_budget` < 1 and our knapsack solver plugged in.

The min-cut partitioner (inductor's, also used by aot_eager_decomp_partition) calls
the configured solver when the budget binds; these tests check that ours is called,
answers like `exact_knapsack`, and that the compiled model trains like eager.
"""

from __future__ import annotations

import pickle

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomKnapsackSolver

from lightning_ckpt.solvers import exact_knapsack
from lightning_ckpt.solvers.compile_adapter import (
    ExactKnapsackSolver,
    exact_knapsack_solver,
)


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.head(self.blocks(x)).squeeze(-1), y)


class Recording:
    """Runtime estimator that also records what the solver was asked."""

    def __init__(self) -> None:
        self.nodes = 0

    def __call__(self, node: torch.fx.Node) -> float:
        self.nodes += 1
        from torch._functorch.partitioners import estimate_runtime

        return estimate_runtime(node)

    def uuid(self) -> str:
        return "recording-v1"


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 32, generator=g), torch.randn(64, generator=g)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def test_solver_is_a_custom_knapsack_solver_with_a_stable_uuid():
    solver = exact_knapsack_solver()
    assert isinstance(solver, CustomKnapsackSolver)
    assert isinstance(solver, ExactKnapsackSolver)
    assert solver.uuid() == exact_knapsack_solver().uuid() is not None
    assert exact_knapsack_solver(lambda node: 1.0).uuid() is None  # unknown estimator: no cache
    assert exact_knapsack_solver(Recording()).uuid() not in (None, solver.uuid())
    assert type(pickle.loads(pickle.dumps(solver))) is ExactKnapsackSolver


def test_solver_calls_exact_knapsack_on_given_memory():
    solver = exact_knapsack_solver(runtime_estimator=lambda node: node)
    nodes = [4.0, 5.0, 6.0]  # the estimator turns each "node" into its runtime
    saved, recomputed = solver([3.0, 4.0, 5.0], None, 7.0, None, nodes)
    assert (saved, recomputed) == exact_knapsack([3.0, 4.0, 5.0], nodes, 7.0)[1:]
    assert solver.calls == 1


def test_compiled_training_with_budget_uses_our_solver():
    """aot_eager_decomp_partition runs inductor's min-cut partitioner (the one that
    calls the knapsack solver) without inductor's C++ code generation, which takes
    about a minute on a cold cache here; the partitioning is the same."""
    backend = "aot_eager_decomp_partition"
    torch.manual_seed(0)
    eager = Net()
    compiled_model = Net()
    compiled_model.load_state_dict(eager.state_dict())
    estimator = Recording()
    solver = exact_knapsack_solver(estimator)
    torch._dynamo.reset()
    settings = {
        "activation_memory_budget": 0.5,
        "activation_memory_budget_solver": solver,
        "enable_autograd_cache": False,  # a cache hit would skip the partitioner
    }
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(settings):
        step = torch.compile(compiled_model, backend=backend)
        x, y = _data()
        loss = step(x, y)
        loss.backward()
        assert solver.calls >= 1 and estimator.nodes >= 1

        ref = eager(x, y)
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        for got, want in zip(_grads(compiled_model), _grads(eager)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

        opt = torch.optim.SGD(compiled_model.parameters(), lr=0.05)
        opt.step()
        losses = [loss.item()]
        for _ in range(5):
            opt.zero_grad()
            loss = step(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
