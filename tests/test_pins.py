"""The test install (.ci/run) pins exact versions of what the version-dependent tests need."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from triton_attn import launch

tomllib = pytest.importorskip("tomllib")  # standard library from Python 3.11

ROOT = Path(__file__).resolve().parent.parent
CI_RUN = ROOT / ".ci" / "run"
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
CONSTRAINTS_ARG = "-c .ci/constraints.txt"


def pins() -> dict[str, str]:
    """Package name -> exact version of every `name==version` line of the constraints file."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line!r} is not an exact pin"
            out[canonicalize_name(req.name)] = spec.version
    return out


def pip_installs() -> list[str]:
    """The pip install lines of .ci/run."""
    return [line for line in CI_RUN.read_text().splitlines() if "pip install" in line]


def test_ci_installs_everything_under_the_constraints():
    installs = pip_installs()
    assert installs, "no pip install in .ci/run"
    for line in installs:
        assert CONSTRAINTS_ARG in line, f"installs without {CONSTRAINTS_ARG}: {line}"


def test_every_package_of_the_test_install_is_pinned_exactly():
    """Each direct requirement .ci/run installs (base + its extras) has a == pin it allows."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [m for line in pip_installs() for m in re.findall(r'-e "\.\[([\w,-]+)\]"', line)]
    assert extras, "no editable install with extras in .ci/run"
    names = [e for group in extras for e in group.split(",")]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for name in names for r in project["optional-dependencies"][name]]
    pinned = pins()
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req} is installed for the tests but has no pin"
        assert req.specifier.contains(pinned[name]), f"pin {name}=={pinned[name]} breaks {req}"
    assert pinned["jaxlib"] == pinned["jax"], "jax and jaxlib are released in pairs"


def test_triton_pin_is_the_release_the_default_tiles_were_tuned_with():
    """The register-spill test checks tiles tuned with one Triton release: CI installs it."""
    release = Version(pins()["triton"]).release[:2]
    assert release == Version(launch.TUNED_WITH_TRITON).release[:2]
