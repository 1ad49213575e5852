"""The GPU session script: its parts under one budget, and what it says when misused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_session.sh"


def run_script(*args: str, budget: int, out: Path) -> subprocess.CompletedProcess:
    # The script calls `python3`: this interpreter's directory first on the path.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "BUDGET": str(budget), "OUT": str(out)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=SCRIPT.parents[1],
    )


def test_a_spent_budget_skips_every_part_and_says_so(tmp_path):
    result = run_script("all", budget=10, out=tmp_path)
    assert result.returncode == 0, result.stderr
    checks = ("cuda-tests.txt", "critical.md")
    timed = ("profile.md", "phases.md", "step_parts.md", "refresh_pass.md")
    timed += ("solvers.md", "compile.md")
    timed += ("step_cost.txt",)
    for name in (*checks, *timed, "adam.txt", "soap.txt", "kron.txt"):
        assert (tmp_path / name).read_text() == "skipped: budget spent\n", name
    assert "torch" in (tmp_path / "gpu.txt").read_text()  # the versions it ran with
    assert not (tmp_path / "momentum.txt").exists()  # fmnist_2c2d_sgd is not in `all`


def test_the_parts_outside_all_run_on_their_own(tmp_path):
    result = run_script("fmnist_2c2d_sgd", budget=10, out=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("momentum.txt", "sgd.txt"):
        assert (tmp_path / name).read_text() == "skipped: budget spent\n", name
    for part, name in [
        ("fmnist_2c2d_packed", "packed.txt"),
        ("fmnist_2c2d_per_layer", "per_layer.txt"),
        ("fmnist_2c2d_default", "dampednewton.txt"),
        ("fmnist_2c2d_adam", "adam.txt"),
        ("refresh_pass", "refresh_pass.md"),
        ("graph_memory", "graph_memory.md"),
        ("fmnist_2c2d_soap", "soap.txt"),
        ("fmnist_2c2d_kron", "kron.txt"),
        ("tests", "cuda-tests.txt"),
        ("refresh_schedule", "refresh_schedule.md"),
        ("fmnist_2c2d_interval30", "interval30.txt"),
        ("fmnist_2c2d_schedule_free", "schedule_free.txt"),
    ]:
        result = run_script(part, budget=10, out=tmp_path / part)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / part / name).read_text() == "skipped: budget spent\n"
        assert not (tmp_path / part / "critical.md").exists()


def test_an_unknown_part_prints_the_usage(tmp_path):
    result = run_script("everything", budget=10, out=tmp_path)
    assert result.returncode == 2
    assert "usage: bash benchmarks/gpu_session.sh all | PART" in result.stderr
    assert run_script(budget=10, out=tmp_path).returncode == 2  # no part at all
