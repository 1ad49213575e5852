"""``python -m benchmarks.run`` that signals itself half-way through writing a result.

Usage: ``python -m tests.benchmarks.interrupted_sweep SIGNAL K HYDRA_ARGS...``: the
K-th write of a ``result.json`` (1-based) writes half of its JSON text, flushes it,
and then sends ``SIGNAL`` (``SIGTERM``, ``SIGINT``) to this process: the worst
moment for a signal to arrive. The earlier jobs finish; the later ones never start.
Only the timing of the signal is arranged; Hydra, the jobs and the writing are real.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import run

REAL_DUMP = json.dump
CONF = Path(__file__).resolve().parents[2] / "conf"
"""Hydra looks for ``conf`` next to ``__main__``, which is this file here."""


def main() -> None:
    """Install the signalling ``json.dump`` and run the multirun of ``sys.argv``."""
    signum = signal.Signals[sys.argv[1]]
    signal_at = int(sys.argv[2])
    # A process started in the background of a non-interactive shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: restore the one
    # an interactive Ctrl-C meets.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [sys.argv[0], f"--config-path={CONF}", *sys.argv[3:]]
    writes = 0

    def dump_then_signal(data: Any, stream: Any, **kwargs: Any) -> None:
        nonlocal writes
        if "result.json" not in str(getattr(stream, "name", "")):
            REAL_DUMP(data, stream, **kwargs)
            return
        writes += 1
        if writes < signal_at:
            REAL_DUMP(data, stream, **kwargs)
            return
        text = json.dumps(data, **kwargs)
        stream.write(text[: len(text) // 2])
        stream.flush()
        os.kill(os.getpid(), signum)
        time.sleep(60)  # SIGTERM ends the process here; SIGINT raises in the sleep

    json.dump = dump_then_signal
    run.main()


if __name__ == "__main__":
    main()
