"""The project's import graph has no cycle and no upward import between layers.

Every `import` and `from ... import` of a project module counts wherever it stands: inside a
function (a lazy import still ties the two modules together), under `if TYPE_CHECKING:` (a
type-only import is still a dependency, and guarding it is how a cycle hides), a literal
name given to `importlib.import_module` (or `__import__`), and the declared targets of a call
that computes the name (DYNAMIC_IMPORTS: an undeclared one fails, since the graph cannot see
where it leads). Layers, lowest first: masks, the shared Triton source, the two kernel
libraries, the CP strategies, the experiments' base (core), what stands on it (runners,
reports), the workloads, and the commands at the top of experiments/ (run.py, driver.py, ...).
Scripts run as `python experiments/x.py` find the packages through the install
(`pip install -e .`) or PYTHONPATH, never by editing sys.path.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
from collections.abc import Iterable, Iterator, Mapping
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
# "module:function" of each import_module call whose name is computed -> the modules it may load
DYNAMIC_IMPORTS: dict[str, tuple[str, ...]] = {
    "shard_strategies:__getattr__": ("shard_strategies.jax_cp", "shard_strategies.torch_cp"),
    "experiments.runners.frameworks:kernels": ("jax_attn", "torch_attn"),
    "experiments.runners.frameworks:cp_module": (
        "shard_strategies.jax_cp",
        "shard_strategies.torch_cp",
    ),
    "torch_attn.flash:load": (
        "flash_attn",
        "flash_attn_interface",
        "flash_attn_3.flash_attn_interface",
        "flash_attn.cute",
    ),
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
    return _resolve(name, names, known)


def _resolve(name: str, names: Iterable[str], known: dict[str, Path]) -> set[str]:
    """The deepest project module of each dotted name, other than `name` itself (none for a
    module outside the project)."""
    out = set()
    for full in names:
        while full and full not in known:
            full = full.rpartition(".")[0]
        if full and full != name:
            out.add(full)
    return out


def _import_call(node: ast.AST) -> str | None:
    """For a call of `import_module` (`importlib.` or not) or `__import__`: "literal" when the
    module name is a string literal, else "computed"; None for any other node."""
    if not (
        isinstance(node, ast.Call)
        and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")
    ):
        return None
    literal = node.args and isinstance(node.args[0], ast.Constant)
    return "literal" if literal and isinstance(node.args[0].value, str) else "computed"


def _scoped(node: ast.AST, scope: str = "") -> Iterator[tuple[ast.AST, str]]:
    """Every node below `node` with the qualified name of the function or class it stands in
    ("" at module level), so a computed import is named by its call site."""
    for child in ast.iter_child_nodes(node):
        yield child, scope
        inner = scope
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = f"{scope}.{child.name}" if scope else child.name
        yield from _scoped(child, inner)


def computed_imports(name: str, source: str) -> set[str]:
    """The call sites ("module:function") in module `name` that import a computed name."""
    return {
        f"{name}:{scope}"
        for node, scope in _scoped(ast.parse(source))
        if _import_call(node) == "computed"
    }


def imports(
    name: str,
    path: Path,
    source: str,
    known: dict[str, Path],
    declared: Mapping[str, tuple[str, ...]] = DYNAMIC_IMPORTS,
) -> set[str]:
    """The project modules that module `name` (file `path`, text `source`) imports, with the
    declared targets of its computed imports."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _import_call(node) == "literal":
            out |= _targets(name, path, node, known)
    for site in computed_imports(name, source):
        out |= _resolve(name, declared.get(site, ()), known)
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


def test_every_computed_import_is_declared():
    """A computed import_module name hides an edge from the graph: each call site must be in
    DYNAMIC_IMPORTS (and each entry must still exist, naming real project modules)."""
    known = modules()
    found = set()
    for name, path in known.items():
        found |= computed_imports(name, path.read_text())
    undeclared = sorted(found - DYNAMIC_IMPORTS.keys())
    assert not undeclared, "computed imports not in DYNAMIC_IMPORTS: " + ", ".join(undeclared)
    stale = sorted(DYNAMIC_IMPORTS.keys() - found)
    assert not stale, "DYNAMIC_IMPORTS entries with no computed import: " + ", ".join(stale)
    missing = [
        target
        for targets in DYNAMIC_IMPORTS.values()
        for target in targets
        if target.split(".")[0] in PACKAGES and target not in known
    ]
    assert not missing, "DYNAMIC_IMPORTS names no such module: " + ", ".join(missing)


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


class Loader:
    def load(self, name):
        return __import__(f"torch_attn.{name}")
"""


def test_the_checks_see_hidden_imports_and_cycles():
    """A type-only import, an import inside a function, a literal import_module name and the
    declared targets of a computed one are edges, the computed one is named by its call site,
    and a two-module cycle is found (so the tests above could fail)."""
    known = modules()
    path = ROOT / "shard_strategies" / "comm.py"
    hidden = {"shard_strategies.plan", "experiments.core.points", "triton_attn.kernels"}
    assert imports("shard_strategies.comm", path, HIDDEN_IMPORTS, known, {}) == hidden
    declared = {"shard_strategies.comm:Loader.load": ("torch_attn.flex", "numpy")}
    assert imports("shard_strategies.comm", path, HIDDEN_IMPORTS, known, declared) == {
        *hidden,
        "torch_attn.flex",
    }
    assert computed_imports("shard_strategies.comm", HIDDEN_IMPORTS) == {
        "shard_strategies.comm:Loader.load"
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


def python_files(root: Path = ROOT) -> list[Path]:
    """Every Python file under `root` that git does not ignore, committed or not (a new file
    is checked before it is added); without git or a checkout, walk_python_files."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return walk_python_files(root)
    return sorted({root / f for f in listed.split("\0") if f and (root / f).is_file()})


def walk_python_files(root: Path) -> list[Path]:
    """The Python files under `root` outside hidden folders and the folders its .gitignore
    names ("name/" anywhere, "/path/" from the root): what git would list, near enough."""
    ignore = root / ".gitignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    folders = [line.strip().rstrip("/") for line in lines if line.strip().endswith("/")]
    found = []
    for here, dirs, names in os.walk(root):
        rel = Path(here).relative_to(root)
        dirs[:] = [d for d in dirs if not d.startswith(".") and not _ignored(rel / d, folders)]
        found += [Path(here) / n for n in names if n.endswith(".py")]
    return sorted(found)


def _ignored(folder: Path, patterns: list[str]) -> bool:
    """Whether a folder (relative to the root) matches a .gitignore folder pattern: one with a
    slash matches the whole relative path, one without the folder's name."""
    return any(
        fnmatch.fnmatch(folder.as_posix(), p.lstrip("/"))
        if "/" in p
        else fnmatch.fnmatch(folder.name, p)
        for p in patterns
    )


def test_python_files_include_new_ones_and_skip_ignored_ones(tmp_path):
    """With git: committed and untracked files, not the ignored ones; without: the same by a
    walk of the tree (so a file under development is checked either way)."""
    (tmp_path / ".gitignore").write_text("build/\n/out/\n*.pyc\n")
    for name in ("a.py", "new.py", "pkg/b.py", "pkg/out/c.py", "build/x.py", "out/y.py", ".v/z.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    want = [tmp_path / n for n in ("a.py", "new.py", "pkg/b.py", "pkg/out/c.py")]
    assert python_files(tmp_path) == want  # not a checkout: the walk
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "a.py", "pkg/b.py"], cwd=tmp_path, check=True)
    (tmp_path / ".v" / "z.py").unlink()  # git lists hidden folders; the walk skips them
    assert python_files(tmp_path) == want


def test_no_file_edits_sys_path():
    """Every Python file git does not ignore (modules, scripts, tests; this one names the calls
    it looks for) imports the packages as installed or from PYTHONPATH: a file that puts a
    folder on sys.path itself hides a broken install."""
    this = Path(__file__).resolve()
    files = [path for path in python_files() if path != this]
    assert {*modules().values(), *(ROOT / "tests").glob("*.py")} - {this} <= set(files)
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        for line in sys_path_edits(path.read_text())
    ]
    assert not bad, "sys.path edited at " + ", ".join(sorted(bad))


def test_the_sys_path_check_sees_every_edit():
    source = "sys.path.insert(0, d)\nsys.path[:0] = [d]\nsys.path += [d]\nx = list(sys.path)\n"
    assert sys_path_edits(source + "sys.path.append(d)\nsys.path = [d]\n") == [1, 2, 3, 5, 6]
