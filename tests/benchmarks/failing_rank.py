"""``benchmarks.run`` under torchrun with one rank failing at its third step.

``FAILING_RANK_MODE=raise``: rank 1 raises; ``hang``: rank 1 sleeps (a rank that
never reaches the next collective); ``kill``: rank 1 is killed (SIGKILL: no Python
clean-up, no exit message, as the kernel's out-of-memory killer does). Run as
``torchrun ... failing_rank.py <overrides>`` by ``test_bench_data_parallel.py``.
"""

import os
import runpy
import signal
import sys
import time

from benchmarks.sweep import training

FAILING_STEP = 3
original_step = training._step
steps_taken: list[int] = []


def failing_step(*args, **kwargs):
    """The training step, failing on rank 1 at step ``FAILING_STEP``."""
    steps_taken.append(1)
    if os.environ["RANK"] == "1" and len(steps_taken) == FAILING_STEP:
        if os.environ["FAILING_RANK_MODE"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ["FAILING_RANK_MODE"] == "hang":
            time.sleep(600)
        raise RuntimeError("injected failure on rank 1")
    return original_step(*args, **kwargs)


training._step = failing_step
sys.argv = ["benchmarks.run", *sys.argv[1:]]
runpy.run_module("benchmarks.run", run_name="__main__", alter_sys=True)
