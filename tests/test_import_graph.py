"""The project's import graph has no cycle and no upward import between layers.

Every `import` and `from ... import` of a project module counts, inside functions too (a lazy
import still ties the two modules together); imports under `if TYPE_CHECKING:` do not, since
they never run. Layers, lowest first: masks, the shared Triton source, the two kernel libraries,
the CP strategies, the experiments' base (core), what stands on it (runners, reports), the
workloads, and the commands at the top of experiments/ (run.py, driver.py, ...).
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


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _targets(name: str, path: Path, node: ast.AST, known: dict[str, Path]) -> set[str]:
    """The project modules an import node loads (the deepest known module of each name)."""
    if isinstance(node, ast.Import):
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


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports at run time."""
    known = modules()
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_only(tree)
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                graph[name] |= _targets(name, path, node, known)
    return graph


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


def test_the_checks_see_lazy_imports_and_cycles():
    """A lazy import inside a function is an edge, a TYPE_CHECKING one is not, and a two-module
    cycle is found (so the tests above could fail)."""
    graph = import_graph()
    assert "experiments.runners.tuned_kernel" in graph["experiments.runners.frameworks"]
    assert "attn_masks.mask" not in graph["attn_masks.tiles"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
