"""Packaging metadata and the lint scope of ``make test`` (pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
