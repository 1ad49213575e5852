"""``python -m benchmarks.micro.cpu_threads`` runs on a tiny setting, prints a table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the threads script in a subprocess

ROOT = Path(__file__).resolve().parents[2]


def test_threads_script_prints_medians_and_ratios():
    command = [sys.executable, "-m", "benchmarks.micro.cpu_threads"]
    command += ["--settings", "gram-eigh", "vivit-mc1", "--batch-size", "8"]
    command += ["--repeats", "1", "--busy", "1"]
    output = subprocess.run(
        command, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300
    ).stdout

    assert "1 busy processes, N=8" in output
    rows = {line.split()[1]: line.split() for line in output.splitlines()[2:]}
    assert set(rows) == {"gram-eigh", "vivit-mc1"}
    for row in rows.values():
        default, helper, single, to_helper, single_to_helper = (
            float(value.rstrip("×")) for value in row[2:7]
        )
        assert min(default, helper, single) >= 0
        if helper >= 1:  # printed to 0.1 ms: ratios of larger times agree
            assert abs(to_helper - default / helper) <= 0.1 * to_helper + 0.05
            assert (
                abs(single_to_helper - single / helper) <= 0.1 * single_to_helper + 0.05
            )
