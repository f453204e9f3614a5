"""The run-wide Settings (experiments/core/flags.py) stay in the driver: flags.py builds them,
driver.py alone takes them and hands the layers below plain values (an out_dir, a seed, a
device count), so a new setting touches the driver and not every module on its way. The
functions that take them return through at most MAX_RETURNS return statements."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILDER = "experiments/core/flags.py"
CONSUMER = "experiments/driver.py"
MAX_RETURNS = 24


def _sources() -> dict[str, str]:
    """Tracked and untracked-but-not-ignored Python files outside tests/, by relative path."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {p: (ROOT / p).read_text() for p in out if not p.startswith("tests/")}


def _names_settings(tree: ast.AST) -> bool:
    """The module names the Settings class anywhere (import, annotation, call)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Settings":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Settings":
            return True
        if isinstance(node, ast.ImportFrom) and any(a.name == "Settings" for a in node.names):
            return True
    return False


def _takers(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions with a parameter named settings or annotated Settings."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            if any(
                p.arg == "settings" or (p.annotation and "Settings" in ast.unparse(p.annotation))
                for p in params
            ):
                out.append(node)
    return out


def _walk(sources: dict[str, str]) -> tuple[set[str], dict[str, int], int]:
    """(files naming Settings, functions taking them per file, their return statements)."""
    naming, taking, returns = set(), {}, 0
    for path, text in sources.items():
        tree = ast.parse(text)
        if _names_settings(tree):
            naming.add(path)
        takers = _takers(tree)
        if takers:
            taking[path] = len(takers)
            returns += sum(isinstance(n, ast.Return) for f in takers for n in ast.walk(f))
    return naming, taking, returns


def test_settings_stop_in_the_driver() -> None:
    naming, taking, returns = _walk(_sources())
    assert naming <= {BUILDER, CONSUMER}, sorted(naming - {BUILDER, CONSUMER})
    assert set(taking) == {CONSUMER}, taking
    assert returns <= MAX_RETURNS, f"{returns} return statements in {taking[CONSUMER]} functions"


def test_the_walk_sees_a_module_below_the_driver_that_takes_settings() -> None:
    sources = {
        CONSUMER: "def run(settings):\n    return 1\n",
        "experiments/runners/x.py": (
            "from experiments.core.flags import Settings\n"
            "def f(s: Settings):\n    if s.dry_run:\n        return 0\n    return 1\n"
        ),
        "experiments/runners/y.py": "def g(settings):\n    return settings.seed\n",
        "experiments/runners/z.py": "def h(out_dir: str):\n    return out_dir\n",
    }
    naming, taking, returns = _walk(sources)
    assert naming == {"experiments/runners/x.py"}
    assert taking == {CONSUMER: 1, "experiments/runners/x.py": 1, "experiments/runners/y.py": 1}
    assert returns == 4
