"""``python -m benchmarks.run`` killed (SIGKILL) right after one checkpoint.

Usage: ``python -m tests.benchmarks.killed_after_checkpoint STEP HYDRA_ARGS...``: once
the checkpoint of step ``STEP`` is saved, the process kills itself, as a preempted or
out-of-memory-killed job ends (no clean-up). The training is real.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from benchmarks import run
from benchmarks.sweep.checkpointing import Checkpointing

CONF = Path(__file__).resolve().parents[2] / "conf"
"""Hydra looks for ``conf`` next to ``__main__``, which is this file here."""
REAL_SAVE = Checkpointing.save


def main() -> None:
    """Kill this process after the checkpoint of step ``sys.argv[1]``."""
    kill_at = int(sys.argv[1])
    sys.argv = [sys.argv[0], f"--config-path={CONF}", *sys.argv[2:]]

    def save_then_die(self: Checkpointing, step: int, *args: Any) -> None:
        REAL_SAVE(self, step, *args)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    Checkpointing.save = save_then_die  # type: ignore[method-assign]
    run.main()


if __name__ == "__main__":
    main()
