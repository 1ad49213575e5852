"""``python -m benchmarks.micro.compile_cost`` runs end to end on a tiny setting."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

pytestmark = pytest.mark.slow  # runs the compile script in a subprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    Version(torch.__version__).release[:2] < (2, 8),
    reason="TorchDynamo's explain of torch 2.4.1 to 2.7.1 counts no graph of the "
    "extended model (make test-floor)",
)
def test_compile_script_reports_graph_breaks_and_both_timings():
    command = [sys.executable, "-m", "benchmarks.micro.compile_cost"]
    command += ["--batch-size", "8", "--repeats", "1", "--threads", "1"]
    output = subprocess.run(
        command, check=True, capture_output=True, text=True, cwd=ROOT, timeout=300
    ).stdout

    graphs = re.search(
        r"as dampednewton sees it: (\d+) graphs, (\d+) graph breaks", output
    )
    assert graphs and int(graphs[1]) == int(graphs[2]) + 1 > 1, output
    apart = re.search(r"compiled vs eager: (\S+) apart", output)
    assert apart and float(apart[1]) < 1e-4, output
    timing = re.search(r"eager (\S+), compiled (\S+), compiled/eager (\S+)", output)
    eager, compiled, ratio = (float(value) for value in timing.groups())
    assert eager > 0 and compiled > 0
    assert abs(ratio - compiled / eager) <= 0.05 * ratio + 0.01
