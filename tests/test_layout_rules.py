"""Layout rules of the package, read from its source with `ast` (nothing is imported).

The package is the pipeline: each stage a folder, in the order of `STAGES`, and a module may
import only from its own stage or an earlier one, with every import counted (module level, inside
functions and methods, under TYPE_CHECKING, `importlib.import_module("...")` with a literal name).
Since every edge points down the order, no chain of imports leads back up. Also: no import cycle,
counting every import as above (an import that only names a type still ties the two modules together);
the two front ends (`frontends/lightning`, `frontends/loops`) do not import each other; Lightning
only in `frontends/lightning/`; DeepSpeed only inside its functions; no torch in `costs/` or
`planning/`; at the package root only the public face, the CLI and the leaf utilities of
`ROOT_MODULES`; no module over 450 lines. Each rule is first tried on a small package written to
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
RULES = ("cycle", "upward", "sides", "root", "lightning", "deepspeed", "torch", "lines")
# the pipeline, first stage first: shared plain data; measuring a step; choosing what to keep;
# applying it; the engine that drives those per batch shape; the report; the front ends
STAGES = ("units", "costs", "profiling", "solvers", "planning", "apply", "engine", "report", "frontends")
ROOT_MODULES = ("__init__", "__main__", "units")  # the public face, the CLI, one leaf utility
TOP = len(STAGES)  # the public face and the CLI import from every stage
FRONT_ENDS = ("frontends.lightning", "frontends.loops")  # side by side: neither imports the other
PLAIN_DATA = ("costs", "planning")  # no torch
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
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
        ):
            sites.append(ImportSite(node.args[0].value, None, node.lineno, in_function, type_checking))
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
    """module -> {imported package module: first line}, every import counted (under TYPE_CHECKING and
    inside functions too: a circle through a type-only import is still a circle of the design, and one
    `from __future__` or `get_type_hints` away from an import error); self-imports left out."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, found in sites.items():
        for site in found:
            target = _resolve(site, modules)
            if target is not None and target != module:
                graph[module].setdefault(target, site.line)
    return graph


def _hop(module: str, target: str, line: int, found: list[ImportSite], modules: dict[str, Path]) -> str:
    """`module (line N)` for the message of a cycle, said to be type-only when every import of `target` is."""
    typed = all(s.type_checking for s in found if _resolve(s, modules) == target)
    return f"{module} (line {line}{', under TYPE_CHECKING' if typed else ''})"


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


def stage_of(module: str) -> tuple[int, str]:
    """(rank in the pipeline, stage name) of a package module; the root's face and CLI rank last."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return TOP, "the package root"
    if parts[1] in STAGES:
        return STAGES.index(parts[1]), parts[1]
    return -1, parts[1]  # not a stage: the "root" rule says so


def _side(module: str) -> str | None:
    rest = module.split(".", 1)[1] if "." in module else ""
    return next((f for f in FRONT_ENDS if _in(rest, f)), None)


def _upward_path(graph: dict[str, dict[str, int]], start: str) -> list[str]:
    """The import chain from `start` to the highest-ranked module it reaches, for the message."""
    parent, queue, best = {start: start}, deque([start]), start
    while queue:
        node = queue.popleft()
        if stage_of(node)[0] > stage_of(best)[0]:
            best = node
        for nxt in sorted(graph[node]):
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    path = [best]
    while path[-1] != start:
        path.append(parent[path[-1]])
    return path[::-1]


def check_package(root: Path) -> list[Violation]:
    """Every layout rule broken by the package at directory `root`, in the order of RULES."""
    pkg = root.name
    modules = module_files(root)
    sites = {m: import_sites(m, path) for m, path in modules.items()}
    graph = import_graph(modules, sites)
    found = []
    for component in _components(graph):
        cycle = _shortest_cycle(graph, component)
        hops = [_hop(a, b, graph[a][b], sites[a], modules) for a, b in zip(cycle, cycle[1:] + cycle[:1])]
        extra = sorted(set(component) - set(cycle))
        detail = "import cycle: " + " -> ".join([*hops, cycle[0]])
        found.append(Violation("cycle", tuple(cycle), detail + (f"; also in it: {', '.join(extra)}" if extra else "")))
    for module, path in modules.items():
        rank, stage = stage_of(module)
        for target, line in graph[module].items():
            target_rank, target_stage = stage_of(target)
            if rank >= 0 and target_rank > rank:
                chain = " -> ".join(_upward_path(graph, target)[1:])
                found.append(Violation(
                    "upward", (module,),
                    f"{module} line {line} imports {target}: {stage} comes before {target_stage} in the pipeline "
                    f"({' -> '.join(STAGES)}), so it may import only from {stage} or earlier stages; move what it "
                    f"needs down to {stage} or earlier" + (f" (that module goes on to {chain})" if chain else ""),
                ))
            if _side(module) and _side(target) and _side(module) != _side(target):
                found.append(Violation(
                    "sides", (module,),
                    f"{module} line {line} imports {target}: the front ends sit side by side; move what both "
                    "need into the engine or an earlier stage",
                ))
        place = path.relative_to(root).parts
        if len(place) == 1 and path.stem not in ROOT_MODULES:
            found.append(Violation(
                "root", (module,), f"{module} sits at the package root: move it into its stage's folder ({', '.join(STAGES[1:])})"
            ))
        elif len(place) > 1 and place[0] not in STAGES:
            found.append(Violation(
                "root", (module,),
                f"{module} is not in a stage folder: put it in one of {', '.join(STAGES[1:])}, or name the new "
                "stage in STAGES at its place in the pipeline",
            ))
        lightning_side = _in(module, f"{pkg}.frontends.lightning")
        for site in sites[module]:
            top = site.target.split(".")[0]
            where = f"{module} line {site.line} imports {site.target}"
            if top in LIGHTNING and not lightning_side:
                found.append(Violation("lightning", (module,), f"{where}: Lightning belongs in {pkg}/frontends/lightning/"))
            if top == "deepspeed" and not (lightning_side and site.in_function):
                found.append(Violation(
                    "deepspeed", (module,), f"{where}: import it inside a function of {pkg}/frontends/lightning/"
                ))
            if top == "torch" and any(_in(module, f"{pkg}.{s}") for s in PLAIN_DATA):
                found.append(Violation("torch", (module,), f"{where}: {stage} works on plain data, without torch"))
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            found.append(Violation("lines", (module,), f"{module} has {lines} lines, over {MAX_LINES}: split it"))
    return sorted(dict.fromkeys(found), key=lambda v: (RULES.index(v.rule), v.modules, v.detail))  # one per statement


# ------------------------------------------------------------------ the rules on a package written here

CLEAN = {
    "__init__.py": (
        "from typing import TYPE_CHECKING\n\n"
        "from lightning_ckpt.planning.plan import Plan\n\n"
        "if TYPE_CHECKING:\n    from lightning_ckpt.frontends.lightning.callback import Callback\n\n\n"
        "def __getattr__(name):\n    import importlib\n\n"
        '    return importlib.import_module("lightning_ckpt.frontends.lightning.callback")\n'
    ),
    "__main__.py": "def main():\n    from lightning_ckpt.frontends.lightning.callback import pl\n",
    "units.py": "X = 0\n" * MAX_LINES,
    "costs/__init__.py": "",
    "costs/block_costs.py": "import dataclasses\n\nfrom lightning_ckpt.units import X\n",
    "profiling/__init__.py": "",
    "profiling/tracker.py": "import torch\n\nfrom lightning_ckpt.costs import block_costs\n",
    "planning/__init__.py": "",
    "planning/plan.py": "import math\n\n\nclass Plan:\n    pass\n",
    "planning/policies.py": "import numpy as np\n\nfrom . import plan\nfrom .plan import Plan\n",
    "apply/__init__.py": "",
    "apply/segments.py": "import torch\n\nfrom lightning_ckpt.profiling.tracker import torch as t\nfrom lightning_ckpt.planning import plan\n",
    "engine/__init__.py": "from lightning_ckpt.engine.checkpoint_engine import Engine\n",
    "engine/checkpoint_engine.py": "from lightning_ckpt.apply.segments import torch\n\n\nclass Engine:\n    pass\n",
    "frontends/__init__.py": "",
    "frontends/loops/__init__.py": "",
    "frontends/loops/auto.py": "from lightning_ckpt.engine import Engine\n",
    "frontends/lightning/__init__.py": "",
    "frontends/lightning/callback.py": (
        "import lightning.pytorch as pl\n\nfrom lightning_ckpt.engine import Engine\n\n\n"
        "def setup():\n    import deepspeed\n\n    return deepspeed\n"
    ),
    "frontends/lightning/strategy.py": (
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


def _rules(root: Path) -> list[tuple[str, tuple[str, ...]]]:
    return [(v.rule, v.modules) for v in check_package(root)]


def test_clean_package_has_no_violations(tmp_path):
    """Imports down the stages, TYPE_CHECKING and importlib imports at the root, lazy deepspeed and
    Lightning in frontends/lightning, 450 lines."""
    assert check_package(write_package(tmp_path)) == []


def test_module_names_and_relative_imports(tmp_path):
    root = write_package(tmp_path)
    modules = module_files(root)
    assert {"lightning_ckpt", "lightning_ckpt.units", "lightning_ckpt.planning.policies",
            "lightning_ckpt.frontends.lightning.callback"} <= set(modules)
    graph = import_graph(modules, {m: import_sites(m, p) for m, p in modules.items()})
    # the TYPE_CHECKING import counts (its line, the first of that target), as the importlib one would
    assert graph["lightning_ckpt"] == {"lightning_ckpt.planning.plan": 3, "lightning_ckpt.frontends.lightning.callback": 6}
    assert graph["lightning_ckpt.planning.policies"] == {"lightning_ckpt.planning.plan": 3}
    assert graph["lightning_ckpt.profiling.tracker"] == {"lightning_ckpt.costs.block_costs": 3}
    assert graph["lightning_ckpt.frontends.loops.auto"] == {"lightning_ckpt.engine": 1}


BACK_EDGES = {
    "function_level_from_import": "def f():\n    from lightning_ckpt.planning.policies import np\n",
    "function_level_import": "def f():\n    import lightning_ckpt.planning.policies\n",
    "relative_submodule": "def f():\n    from . import policies\n",
    "method_level": "class P:\n    def f(self):\n        from .policies import np\n",
    "type_checking": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .policies import np\n",
    "type_checking_in_function": "def f():\n    if TYPE_CHECKING:\n        from .policies import np\n",
}


@pytest.mark.parametrize("back_edge", BACK_EDGES.values(), ids=BACK_EDGES.keys())
def test_cycle_through_a_function_level_import(tmp_path, back_edge):
    violations = check_package(write_package(tmp_path, planning__plan=back_edge))
    assert [(v.rule, v.modules) for v in violations] == [
        ("cycle", ("lightning_ckpt.planning.plan", "lightning_ckpt.planning.policies"))
    ]
    assert "lightning_ckpt.planning.policies (line 3) -> lightning_ckpt.planning.plan" in str(violations[0])


def test_cycle_of_three_reports_each_module(tmp_path):
    root = write_package(
        tmp_path, planning__plan="from lightning_ckpt.planning.tables import X\n",
        planning__tables="from lightning_ckpt.planning.policies import np\n",
    )
    assert [v.modules for v in check_package(root) if v.rule == "cycle"] == [
        ("lightning_ckpt.planning.plan", "lightning_ckpt.planning.tables", "lightning_ckpt.planning.policies")
    ]


def test_a_module_importing_itself_is_not_a_cycle(tmp_path):
    assert check_package(write_package(tmp_path, planning__plan="from lightning_ckpt.planning import plan\n")) == []


def test_a_module_that_names_its_caller_only_for_a_type_closes_a_cycle(tmp_path):
    """The engine imports measured_steps at module level; measured_steps imports the engine's class under
    TYPE_CHECKING for an annotation: the two modules depend on each other, so the rule fails."""
    root = write_package(
        tmp_path,
        engine__checkpoint_engine="from lightning_ckpt.engine.measured_steps import judge\n\n\nclass Engine:\n    pass\n",
        engine__measured_steps=(
            "from __future__ import annotations\n\nfrom typing import TYPE_CHECKING\n\n"
            "if TYPE_CHECKING:\n    from lightning_ckpt.engine.checkpoint_engine import Engine\n\n\n"
            "def judge(engine: Engine) -> None:\n    pass\n"
        ),
    )
    violations = check_package(root)
    assert [(v.rule, v.modules) for v in violations] == [
        ("cycle", ("lightning_ckpt.engine.checkpoint_engine", "lightning_ckpt.engine.measured_steps"))
    ]
    assert str(violations[0]) == (
        "[cycle] import cycle: lightning_ckpt.engine.checkpoint_engine (line 1) -> "
        "lightning_ckpt.engine.measured_steps (line 6, under TYPE_CHECKING) -> lightning_ckpt.engine.checkpoint_engine"
    )


@pytest.mark.parametrize(
    ("module", "text", "target"),
    [
        # module level, in a function, in a method, under TYPE_CHECKING, through importlib, relative
        ("profiling__tracker", "from lightning_ckpt.planning.plan import Plan\n", "lightning_ckpt.planning.plan"),
        ("profiling__tracker", "def f():\n    from lightning_ckpt.apply.segments import t\n", "lightning_ckpt.apply.segments"),
        ("planning__plan", "class P:\n    def f(self):\n        import lightning_ckpt.apply.segments\n",
         "lightning_ckpt.apply.segments"),
        ("costs__block_costs", "if TYPE_CHECKING:\n    from lightning_ckpt.profiling.tracker import torch\n",
         "lightning_ckpt.profiling.tracker"),
        ("apply__segments", "import importlib\n\nE = importlib.import_module('lightning_ckpt.engine.checkpoint_engine')\n",
         "lightning_ckpt.engine.checkpoint_engine"),
        ("planning__plan", "def f():\n    from ..profiling import tracker\n", None),  # planning -> profiling is down
        ("engine__checkpoint_engine", "def f():\n    from ..frontends.loops import auto\n", "lightning_ckpt.frontends.loops.auto"),
        ("planning__plan", "def f():\n    from lightning_ckpt import Plan\n", "lightning_ckpt"),  # the face is the top
    ],
    ids=["module_level", "function", "method", "type_checking", "importlib", "downward", "relative", "root_face"],
)
def test_an_import_up_the_pipeline_fails(tmp_path, module, text, target):
    violations = [v for v in check_package(write_package(tmp_path, **{module: text})) if v.rule == "upward"]
    if target is None:
        assert violations == []
        return
    assert [v.modules for v in violations] == [("lightning_ckpt." + module.replace("__", "."),)]
    assert f"imports {target}:" in str(violations[0]) and "comes before" in str(violations[0])


def test_an_upward_import_names_where_the_chain_goes(tmp_path):
    """costs -> profiling is upward; the message follows profiling's own imports to the highest stage."""
    root = write_package(
        tmp_path, costs__block_costs="from lightning_ckpt.profiling import tracker\n",
        profiling__tracker="def f():\n    from lightning_ckpt.engine.checkpoint_engine import Engine\n",
    )
    upward = [v for v in check_package(root) if v.rule == "upward"]
    assert [v.modules for v in upward] == [("lightning_ckpt.costs.block_costs",), ("lightning_ckpt.profiling.tracker",)]
    assert "goes on to lightning_ckpt.engine.checkpoint_engine" in str(upward[0])


def test_the_front_ends_do_not_import_each_other(tmp_path):
    root = write_package(tmp_path, frontends__loops__auto="def f():\n    from lightning_ckpt.frontends.lightning import callback\n")
    assert _rules(root) == [("sides", ("lightning_ckpt.frontends.loops.auto",))]


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("report", "X = 1\n", [("root", ("lightning_ckpt.report",))]),  # a module at the root, not a stage
        ("extras__tool", "X = 1\n", [("root", ("lightning_ckpt.extras.tool",))]),  # a folder that is no stage
    ],
)
def test_only_the_face_the_cli_and_leaf_utilities_at_the_root(tmp_path, name, text, expected):
    assert _rules(write_package(tmp_path, **{name: text})) == expected


@pytest.mark.parametrize("text", ["import lightning\n", "def f():\n    from pytorch_lightning import Trainer\n"])
def test_lightning_outside_its_front_end(tmp_path, text):
    violations = check_package(write_package(tmp_path, frontends__loops__auto=text))
    assert [(v.rule, v.modules) for v in violations] == [("lightning", ("lightning_ckpt.frontends.loops.auto",))]
    assert "Lightning belongs in lightning_ckpt/frontends/lightning/" in str(violations[0])


@pytest.mark.parametrize(
    ("module", "text"),
    [
        ("frontends__lightning__callback", "import deepspeed\n"),
        ("frontends__lightning__callback", "class S:\n    from deepspeed import initialize\n"),
        ("apply__segments", "def f():\n    import deepspeed.comm\n"),
    ],
)
def test_deepspeed_outside_functions_of_the_lightning_front_end(tmp_path, module, text):
    violations = check_package(write_package(tmp_path, **{module: text}))
    assert [(v.rule, v.modules) for v in violations] == [("deepspeed", ("lightning_ckpt." + module.replace("__", "."),))]


@pytest.mark.parametrize(
    ("module", "text"),
    [
        ("planning__capacity", "import torch\n"),
        ("planning__capacity", "def f():\n    from torch import nn\n"),
        ("costs__block_costs", "if TYPE_CHECKING:\n    import torch.nn\n"),
    ],
)
def test_torch_in_the_plain_data_stages(tmp_path, module, text):
    violations = check_package(write_package(tmp_path, **{module: text}))
    assert [(v.rule, v.modules) for v in violations] == [("torch", ("lightning_ckpt." + module.replace("__", "."),))]


def test_module_over_450_lines(tmp_path):
    violations = check_package(write_package(tmp_path, units="X = 0\n" * (MAX_LINES + 1)))
    assert [(v.rule, v.modules) for v in violations] == [("lines", ("lightning_ckpt.units",))]
    assert "451 lines, over 450" in str(violations[0])


# ------------------------------------------------------------------ the real package


@pytest.mark.parametrize("rule", RULES)
def test_lightning_ckpt_follows_the_layout_rules(rule):
    violations = [v for v in check_package(PACKAGE_ROOT) if v.rule == rule]
    assert not violations, "\n".join(map(str, violations))


def test_lightning_ckpt_is_laid_out_as_the_pipeline():
    """Every folder of the package is a stage of STAGES, and the root holds only ROOT_MODULES."""
    folders = {p.name for p in PACKAGE_ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(STAGES) - {"units"}
    assert {p.stem for p in PACKAGE_ROOT.glob("*.py")} == set(ROOT_MODULES)
