"""Layout rules of the package, read from its source with `ast` (nothing is imported).

No import cycle among the package's modules; Lightning only in `integrations/`;
DeepSpeed only inside functions of `integrations/`; no torch in `planning/`; nothing in
`profiling/` or `planning/` imports the modules that apply plans (`apply*`), even inside a
function: they come later in the pipeline; no module over 450 lines. Each rule is first tried on a small package written to
`tmp_path`, then the real `lightning_ckpt` is checked.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

MAX_LINES = 450
LIGHTNING = {"lightning", "pytorch_lightning"}
RULES = ("cycle", "lightning", "deepspeed", "torch", "apply", "lines")
EARLY_STAGES = ("profiling", "planning")  # the stages before a plan is applied
PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "lightning_ckpt"


@dataclass(frozen=True)
class ImportSite:
    """One imported name: `import a.b` gives target "a.b", name None; `from a import b` gives "a", "b"."""

    target: str
    name: str | None
    line: int
    in_function: bool
    type_checking: bool


@dataclass(frozen=True)
class Violation:
    rule: str
    modules: tuple[str, ...]  # the offending module, or the modules of a cycle in import order
    detail: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.detail}"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package directory `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_sites(module: str, path: Path) -> list[ImportSite]:
    """Every import statement in the file, at any depth, with where it sits."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    sites: list[ImportSite] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            sites.extend(ImportSite(a.name, None, node.lineno, in_function, type_checking) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x` in a/b/c.py is `from a.b import x`
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            sites.extend(ImportSite(target, a.name, node.lineno, in_function, type_checking) for a in node.names)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_checking)
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_checking)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), False, False)
    return sites


def _resolve(site: ImportSite, modules: dict[str, Path]) -> str | None:
    """The package module a site loads: `from a.b import y` is a.b.y when y is a submodule, else a.b."""
    if site.name is not None and f"{site.target}.{site.name}" in modules:
        return f"{site.target}.{site.name}"
    parts = site.target.split(".")
    for k in range(len(parts), 0, -1):  # the longest prefix that is a module of the package
        if ".".join(parts[:k]) in modules:
            return ".".join(parts[:k])
    return None


def import_graph(modules: dict[str, Path], sites: dict[str, list[ImportSite]]) -> dict[str, dict[str, int]]:
    """module -> {imported package module: first line}; TYPE_CHECKING imports and self-imports left out."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, found in sites.items():
        for site in found:
            target = None if site.type_checking else _resolve(site, modules)
            if target is not None and target != module:
                graph[module].setdefault(target, site.line)
    return graph


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return sorted(found)


def _shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """The shortest cycle through the component's first module, staying inside the component."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            if nxt in members and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {component}")


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _applier(site: ImportSite, modules: dict[str, Path], pkg: str) -> str | None:
    """The module that applies plans (`pkg.apply`, `pkg.apply_*`) a site imports, if any."""
    for name in filter(None, (_resolve(site, modules), site.target, f"{site.target}.{site.name}" if site.name else None)):
        parts = name.split(".")
        if len(parts) >= 2 and parts[0] == pkg and (parts[1] == "apply" or parts[1].startswith("apply_")):
            return ".".join(parts[:2])
    return None


def check_package(root: Path) -> list[Violation]:
    """Every layout rule broken by the package at directory `root`, in the order of RULES."""
    pkg = root.name
    modules = module_files(root)
    sites = {m: import_sites(m, path) for m, path in modules.items()}
    graph = import_graph(modules, sites)
    found = []
    for component in _components(graph):
        cycle = _shortest_cycle(graph, component)
        hops = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
        extra = sorted(set(component) - set(cycle))
        detail = "import cycle: " + " -> ".join([*hops, cycle[0]])
        found.append(Violation("cycle", tuple(cycle), detail + (f"; also in it: {', '.join(extra)}" if extra else "")))
    for module, path in modules.items():
        integrations = _in(module, f"{pkg}.integrations")
        early = any(_in(module, f"{pkg}.{stage}") for stage in EARLY_STAGES)
        for site in sites[module]:
            top = site.target.split(".")[0]
            where = f"{module} line {site.line} imports {site.target}"
            if top in LIGHTNING and not integrations:
                found.append(Violation("lightning", (module,), f"{where}: Lightning belongs in {pkg}/integrations/"))
            if top == "deepspeed" and not (integrations and site.in_function):
                found.append(Violation("deepspeed", (module,), f"{where}: import it inside a function of {pkg}/integrations/"))
            if top == "torch" and _in(module, f"{pkg}.planning"):
                found.append(Violation("torch", (module,), f"{where}: planning works on plain data, without torch"))
            applier = _applier(site, modules, pkg)
            if early and applier:
                found.append(Violation(
                    "apply", (module,),
                    f"{where}{'' if applier == site.target else f' ({applier})'}: profiling and planning come before "
                    f"a plan is applied; move the code that needs {applier} to a module beside it",
                ))
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            found.append(Violation("lines", (module,), f"{module} has {lines} lines, over {MAX_LINES}: split it"))
    return sorted(dict.fromkeys(found), key=lambda v: (RULES.index(v.rule), v.modules))  # one per statement


# ------------------------------------------------------------------ the rules on a package written here

CLEAN = {
    "__init__.py": (
        "from typing import TYPE_CHECKING\n\n"
        "from lightning_ckpt.planning.plan import Plan\n\n"
        "if TYPE_CHECKING:\n    from lightning_ckpt.integrations.callback import Callback\n\n\n"
        "def __getattr__(name):\n    import importlib\n\n"
        '    return importlib.import_module("lightning_ckpt.integrations.callback")\n'
    ),
    "units.py": "X = 0\n" * MAX_LINES,
    "planning/__init__.py": "",
    "planning/plan.py": "import math\n\n\nclass Plan:\n    pass\n",
    "planning/policies.py": "import numpy as np\n\nfrom . import plan\nfrom .plan import Plan\n",
    "profiling/__init__.py": "",
    "profiling/tracker.py": "import torch\n\nfrom lightning_ckpt.planning import policies\n",
    "integrations/__init__.py": "",
    "integrations/callback.py": (
        "import lightning.pytorch as pl\n\nfrom ..profiling.tracker import torch\n\n\n"
        "def setup():\n    import deepspeed\n\n    return deepspeed\n"
    ),
    "integrations/strategy.py": (
        "from pytorch_lightning.strategies import Strategy\n\n\n"
        "class DeepSpeed(Strategy):\n    def setup(self):\n        from deepspeed import initialize\n"
    ),
}


def write_package(tmp_path: Path, **changes: str) -> Path:
    """The clean package with files added or replaced (keys use "__" for "/")."""
    root = tmp_path / "lightning_ckpt"
    for name, text in {**CLEAN, **{k.replace("__", "/") + ".py": v for k, v in changes.items()}}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def test_clean_package_has_no_violations(tmp_path):
    """TYPE_CHECKING and importlib imports, lazy deepspeed and Lightning in integrations, 450 lines."""
    assert check_package(write_package(tmp_path)) == []


def test_module_names_and_relative_imports(tmp_path):
    root = write_package(tmp_path)
    modules = module_files(root)
    assert set(modules) == {
        "lightning_ckpt",
        "lightning_ckpt.units",
        "lightning_ckpt.planning",
        "lightning_ckpt.planning.plan",
        "lightning_ckpt.planning.policies",
        "lightning_ckpt.profiling",
        "lightning_ckpt.profiling.tracker",
        "lightning_ckpt.integrations",
        "lightning_ckpt.integrations.callback",
        "lightning_ckpt.integrations.strategy",
    }
    graph = import_graph(modules, {m: import_sites(m, p) for m, p in modules.items()})
    assert graph["lightning_ckpt"] == {"lightning_ckpt.planning.plan": 3}  # the TYPE_CHECKING one is left out
    assert graph["lightning_ckpt.planning.policies"] == {"lightning_ckpt.planning.plan": 3}
    assert graph["lightning_ckpt.profiling.tracker"] == {"lightning_ckpt.planning.policies": 3}
    assert graph["lightning_ckpt.integrations.callback"] == {"lightning_ckpt.profiling.tracker": 3}


BACK_EDGES = {
    "function_level_from_import": "def f():\n    from lightning_ckpt.planning.policies import np\n",
    "function_level_import": "def f():\n    import lightning_ckpt.planning.policies\n",
    "relative_submodule": "def f():\n    from . import policies\n",
    "method_level": "class P:\n    def f(self):\n        from .policies import np\n",
}


@pytest.mark.parametrize("back_edge", BACK_EDGES.values(), ids=BACK_EDGES.keys())
def test_cycle_through_a_function_level_import(tmp_path, back_edge):
    violations = check_package(write_package(tmp_path, planning__plan=back_edge))
    assert [(v.rule, v.modules) for v in violations] == [
        ("cycle", ("lightning_ckpt.planning.plan", "lightning_ckpt.planning.policies"))
    ]
    assert "lightning_ckpt.planning.policies (line 3) -> lightning_ckpt.planning.plan" in str(violations[0])


def test_cycle_of_three_reports_each_module(tmp_path):
    root = write_package(tmp_path, planning__plan="from lightning_ckpt.profiling.tracker import torch\n")
    assert [v.modules for v in check_package(root)] == [
        ("lightning_ckpt.planning.plan", "lightning_ckpt.profiling.tracker", "lightning_ckpt.planning.policies")
    ]


@pytest.mark.parametrize(
    "text",
    [
        "if TYPE_CHECKING:\n    from .policies import np\n",
        "import importlib\n\nP = importlib.import_module('lightning_ckpt.planning.policies')\n",
        "from lightning_ckpt.planning import plan\n",  # imports itself: not a cycle
    ],
    ids=["type_checking", "importlib", "self"],
)
def test_not_a_cycle(tmp_path, text):
    assert check_package(write_package(tmp_path, planning__plan=text)) == []


@pytest.mark.parametrize(
    ("text", "cycle"),
    [
        ("import lightning_ckpt.units\n", False),
        ("from lightning_ckpt import units\n", False),
        ("from lightning_ckpt import planning\n", False),
        ("from lightning_ckpt import Plan\n", True),
    ],
)
def test_only_a_name_from_a_package_is_an_edge_to_its_init(tmp_path, text, cycle):
    """lightning_ckpt/__init__.py imports planning.plan: only `from lightning_ckpt import Plan` closes a cycle."""
    violations = check_package(write_package(tmp_path, planning__plan=text))
    assert [v.modules for v in violations] == ([("lightning_ckpt", "lightning_ckpt.planning.plan")] if cycle else [])


@pytest.mark.parametrize("text", ["import lightning\n", "def f():\n    from pytorch_lightning import Trainer\n"])
def test_lightning_outside_integrations(tmp_path, text):
    violations = check_package(write_package(tmp_path, report=text))
    assert [(v.rule, v.modules) for v in violations] == [("lightning", ("lightning_ckpt.report",))]
    assert "Lightning belongs in lightning_ckpt/integrations/" in str(violations[0])


@pytest.mark.parametrize(
    ("module", "text"),
    [
        ("integrations__callback", "import deepspeed\n"),
        ("integrations__callback", "class S:\n    from deepspeed import initialize\n"),
        ("apply", "def f():\n    import deepspeed.comm\n"),
    ],
)
def test_deepspeed_outside_functions_of_integrations(tmp_path, module, text):
    violations = check_package(write_package(tmp_path, **{module: text}))
    assert [(v.rule, v.modules) for v in violations] == [("deepspeed", ("lightning_ckpt." + module.replace("__", "."),))]


@pytest.mark.parametrize(
    "text",
    ["import torch\n", "def f():\n    from torch import nn\n", "if TYPE_CHECKING:\n    import torch.nn\n"],
)
def test_torch_in_planning(tmp_path, text):
    violations = check_package(write_package(tmp_path, planning__capacity=text))
    assert [(v.rule, v.modules) for v in violations] == [("torch", ("lightning_ckpt.planning.capacity",))]


@pytest.mark.parametrize(
    ("module", "text"),
    [
        ("profiling__tracker", "import torch\n\n\ndef f():\n    from lightning_ckpt.apply import apply_segments\n"),
        ("profiling__tracker", "import torch\n\nfrom lightning_ckpt import apply_selective\n"),
        ("planning__plan", "import lightning_ckpt.apply\n"),
        ("planning__plan", "from ..apply_compiled import x\n"),
    ],
)
def test_apply_from_profiling_or_planning(tmp_path, module, text):
    root = write_package(tmp_path, **{module: text}, apply="X = 1\n", apply_selective="X = 1\n")
    violations = [v for v in check_package(root) if v.rule == "apply"]
    assert [v.modules for v in violations] == [("lightning_ckpt." + module.replace("__", "."),)]
    assert "profiling and planning come before a plan is applied" in str(violations[0])


def test_apply_from_later_stages_and_look_alikes_is_fine(tmp_path):
    """integrations and top-level modules may apply plans; `applied_marks` is not `apply*`."""
    root = write_package(
        tmp_path,
        apply="X = 1\n",
        keep_calibration="from lightning_ckpt.apply import X\n",
        integrations__callback="import lightning.pytorch as pl\n\nfrom lightning_ckpt.apply import X\n",
        profiling__applied_marks="X = 1\n",
        profiling__tracker="import torch\n\nfrom lightning_ckpt.profiling.applied_marks import X\n",
    )
    assert check_package(root) == []


def test_module_over_450_lines(tmp_path):
    violations = check_package(write_package(tmp_path, units="X = 0\n" * (MAX_LINES + 1)))
    assert [(v.rule, v.modules) for v in violations] == [("lines", ("lightning_ckpt.units",))]
    assert "451 lines, over 450" in str(violations[0])


# ------------------------------------------------------------------ the real package


@pytest.mark.parametrize("rule", RULES)
def test_lightning_ckpt_follows_the_layout_rules(rule):
    violations = [v for v in check_package(PACKAGE_ROOT) if v.rule == rule]
    assert not violations, "\n".join(map(str, violations))
