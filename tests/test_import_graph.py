"""The project's import graph has no cycle and no upward import between layers.

Every `import` and `from ... import` of a project module counts wherever it stands: inside a
function (a lazy import still ties the two modules together), under `if TYPE_CHECKING:` (a
type-only import is still a dependency, and guarding it is how a cycle hides), and a literal
name given to `importlib.import_module`. Layers, lowest first: masks, the shared Triton source,
the two kernel libraries, the CP strategies, the experiments' base (core), what stands on it
(runners, reports), the workloads, and the commands at the top of experiments/ (run.py,
driver.py, ...). Scripts run as `python experiments/x.py` find the packages through the install
(`pip install -e .`) or PYTHONPATH, never by editing sys.path.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "attn_masks",
    "triton_attn",
    "jax_attn",
    "torch_attn",
    "shard_strategies",
    "experiments",
)
LAYERS = {
    "attn_masks": 0,
    "triton_attn": 1,
    "jax_attn": 2,
    "torch_attn": 2,
    "shard_strategies": 3,
    "experiments.core": 4,
    "experiments.runners": 5,
    "experiments.reports": 5,
    "experiments.workloads": 6,
    "experiments": 7,
}


def modules() -> dict[str, Path]:
    """Dotted name -> file of every project module (a package by its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(name: str, path: Path, node: ast.AST, known: dict[str, Path]) -> set[str]:
    """The project modules an import statement or import_module call loads (the deepest known
    module of each name)."""
    if isinstance(node, ast.Call):
        names = [node.args[0].value]
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            here = here[: len(here) - (node.level - 1)]
            base = ".".join(here + ([base] if base else []))
        # `from p import x` loads module p.x when there is one, else takes x from p
        names = [f"{base}.{a.name}" if base else a.name for a in node.names]
    out = set()
    for full in names:
        while full and full not in known:
            full = full.rpartition(".")[0]
        if full and full != name:
            out.add(full)
    return out


def _imports_by_name(node: ast.AST) -> bool:
    """Whether `node` is `importlib.import_module("literal")` (or `import_module(...)` alone)."""
    return (
        isinstance(node, ast.Call)
        and ast.unparse(node.func).split(".")[-1] == "import_module"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def imports(name: str, path: Path, source: str, known: dict[str, Path]) -> set[str]:
    """The project modules that module `name` (file `path`, text `source`) imports."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _imports_by_name(node):
            out |= _targets(name, path, node, known)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    known = modules()
    return {name: imports(name, path, path.read_text(), known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> str:
    """The layer a module belongs to (its longest prefix in LAYERS)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no layer")


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_reaches_up_or_across_layers():
    bad = []
    for module, targets in import_graph().items():
        mine = layer(module)
        for target in targets:
            theirs = layer(target)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not bad, "\n".join(sorted(bad))


HIDDEN_IMPORTS = """
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import CPPlan


def run():
    import experiments.core.points as points
    return importlib.import_module("triton_attn.kernels")
"""


def test_the_checks_see_hidden_imports_and_cycles():
    """A type-only import, an import inside a function and a literal import_module name are
    edges, and a two-module cycle is found (so the tests above could fail)."""
    known = modules()
    path = ROOT / "shard_strategies" / "comm.py"
    assert imports("shard_strategies.comm", path, HIDDEN_IMPORTS, known) == {
        "shard_strategies.plan",
        "experiments.core.points",
        "triton_attn.kernels",
    }
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def sys_path_edits(source: str) -> list[int]:
    """The lines of `source` that change sys.path: a call of one of its methods or an
    assignment to it (whole, a slice, +=)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            targets = [node.func]
        elif isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        else:
            continue
        names = [ast.unparse(t) for t in targets]
        if any(n == "sys.path" or n.startswith(("sys.path.", "sys.path[")) for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_file_edits_sys_path():
    """Project modules, scripts and tests import the packages as installed (or from PYTHONPATH):
    a script that puts the repository on sys.path itself hides a broken install."""
    files = [*modules().values(), *(ROOT / "tests").glob("*.py")]
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        for line in sys_path_edits(path.read_text())
    ]
    assert not bad, "sys.path edited at " + ", ".join(sorted(bad))


def test_the_sys_path_check_sees_every_edit():
    source = "sys.path.insert(0, d)\nsys.path[:0] = [d]\nsys.path += [d]\nx = list(sys.path)\n"
    assert sys_path_edits(source + "sys.path.append(d)\nsys.path = [d]\n") == [1, 2, 3, 5, 6]
