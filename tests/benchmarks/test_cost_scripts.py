"""The cost scripts run end to end on tiny settings and print well-formed tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the cost scripts in subprocesses

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    command = [sys.executable, "-m", f"benchmarks.micro.{args[0]}", *args[1:]]
    result = subprocess.run(
        command, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    return result.stdout


def test_step_cost_prints_one_row_per_variant_with_ratios():
    output = _run(
        "step_cost",
        *("--models", "mlp", "--batch-sizes", "8", "--ggn", "mc1", "exact"),
        *("--repeats", "1", "--threads", "1"),
    )
    rows = [line.split() for line in output.splitlines() if line.startswith("mlp ")]
    assert [row[2] for row in rows] == ["mc1", "exact"]
    for row in rows:
        sgd, fast, fast_ratio, dense, dense_ratio, default, default_ratio = (
            float(value.rstrip("×")) for value in row[3:10]
        )
        assert min(sgd, fast, dense, default) > 0
        assert abs(default_ratio - default / sgd) <= 0.05 * default_ratio + 0.1
        # Printed times are rounded (SGD to 0.01 ms): ratios agree to a few percent.
        assert abs(fast_ratio - fast / sgd) <= 0.05 * fast_ratio + 0.1
        assert abs(dense_ratio - dense / sgd) <= 0.05 * dense_ratio + 0.1


def test_step_cost_memory_runs_each_variant_in_a_fresh_process():
    output = _run(
        "step_cost",
        *("--models", "mlp", "--batch-sizes", "8", "--ggn", "mc1"),
        *("--repeats", "1", "--threads", "1", "--memory", "--skip-materialized"),
    )
    (row,) = [line.split() for line in output.splitlines() if line.startswith("mlp ")]
    sgd_mib, fast_mib = float(row[10]), float(row[11])
    assert sgd_mib >= 0 and fast_mib >= 0
    # The skipped materialized path: time, ratio and memory cells say "not run".
    assert (row[6], row[7], row[12]) == ("—", "—", "—")
    assert "nan" not in output.lower()
