"""Packaging metadata and the lint scope of ``make test`` (pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UNFORMATTED = "import os\nvalues=[1,\n  2]\n"  # unformatted, unused import


def test_license_is_an_spdx_string_with_a_build_backend_that_reads_it():
    # A TOML table (`{ text = "MIT" }`) makes setuptools warn that it is deprecated.
    assert PYPROJECT["project"]["license"] == "MIT"
    (setuptools,) = [
        Requirement(r)
        for r in PYPROJECT["build-system"]["requires"]
        if Requirement(r).name == "setuptools"
    ]
    # SPDX expressions in `project.license` need setuptools >= 77.
    assert not setuptools.specifier.contains("76.9")
    assert setuptools.specifier.contains("77.0")


def _ruff(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_lint_ignores_a_scratch_file_outside_the_project(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    package = tmp_path / "dampednewton"
    package.mkdir()
    (package / "module.py").write_text('"""A formatted module."""\n')
    (tmp_path / "scratch.py").write_text(UNFORMATTED)
    for command in (("format", "--check", "."), ("check", ".")):
        process = _ruff(*command, cwd=tmp_path)
        assert process.returncode == 0, process.stdout + process.stderr


def test_lint_still_checks_the_project_files(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for folder in ("dampednewton", "benchmarks", "tests"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "module.py").write_text(UNFORMATTED)
        process = _ruff("format", "--check", ".", cwd=tmp_path)
        assert process.returncode == 1, f"{folder}: {process.stdout}"
        assert f"{folder}/module.py" in process.stdout
        (tmp_path / folder / "module.py").unlink()


def _torch_floor() -> str:
    (torch,) = [
        Requirement(r)
        for r in PYPROJECT["project"]["dependencies"]
        if Requirement(r).name == "torch"
    ]
    (spec,) = torch.specifier
    assert spec.operator == ">=", f"torch needs a floor, not {spec}"
    return spec.version


def test_torch_floor_admits_no_version_without_the_apis_at_import():
    # Every policy module calls torch.serialization.add_safe_globals at import (2.4).
    floor = tuple(int(part) for part in _torch_floor().split("."))
    assert floor >= (2, 4)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_floor_installs_the_declared_floor():
    # `make test-floor` (not part of `make test`) runs the suite on that torch.
    process = subprocess.run(
        ["make", "-n", "test-floor"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert process.returncode == 0, process.stderr
    assert f'"torch=={_torch_floor()}.*"' in process.stdout
    assert "pytest" in process.stdout
