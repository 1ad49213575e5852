"""examples/distributed_mlp.py checks itself under torchrun.

Every rank's DDP model must end with the parameters of a single-process twin trained
on the global batches.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.markdown import ROOT

EXAMPLE = ROOT / "examples" / "distributed_mlp.py"


def test_the_distributed_example_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE)]
    completed = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "2 ranks" in completed.stdout and "the same parameters" in completed.stdout
