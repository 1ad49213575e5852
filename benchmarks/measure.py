"""Device selection, synchronized wall-clock timing and peak memory.

Peak memory has different meanings on the two kinds of device:

* CUDA (``cuda_max_memory_allocated``): ``torch.cuda.max_memory_allocated`` after
  resetting the peak at the start of the job, i.e. the job's own high-water mark of
  tensor memory (data, model, optimizer state, temporaries).
* CPU on Linux (``cpu_job_peak_rss``): the process's resident-set high-water mark
  (``VmHWM`` in ``/proc/self/status``) since the start of the job, which resets it by
  writing ``5`` to ``/proc/self/clear_refs``. It covers everything resident in the
  process during the job: Python, the libraries, and what earlier jobs of a
  sequential multirun left resident (``at_start_mb``), but not their peaks.
* CPU elsewhere, or where the reset is refused (``cpu_process_max_rss``):
  ``resource.getrusage(RUSAGE_SELF).ru_maxrss``, the high-water mark of the whole
  process, which cannot be reset: in a sequential multirun a job reports the maximum
  over itself and every earlier job. Compare such readings only from separate
  processes (one ``python -m benchmarks.run`` per job).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass

import torch


def resolve_device(name: str) -> torch.device:
    """Turn the ``device`` setting into a device.

    Args:
        name: ``"auto"`` (CUDA when available, else CPU) or a torch device string.

    Returns:
        The device.

    Raises:
        ValueError: If CUDA is requested but unavailable.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={name!r} but CUDA is not available; use device=auto or cpu."
        )
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """Map ``"float32"``/``"float64"`` to the torch dtype.

    Args:
        name: The ``dtype`` setting.

    Returns:
        The dtype.

    Raises:
        ValueError: For any other name.
    """
    dtypes = {"float32": torch.float32, "float64": torch.float64}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {name!r}.")
    return dtypes[name]


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on a CUDA device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall-clock intervals that include all queued device work."""

    def __init__(self, device: torch.device) -> None:
        """Time work on ``device``.

        Args:
            device: The device whose kernels must finish before a reading.
        """
        self._device = device
        self._start: float | None = None

    def start(self) -> None:
        """Synchronize and start an interval."""
        synchronize(self._device)
        self._start = time.perf_counter()

    def stop(self) -> float:
        """Synchronize and return the seconds since :meth:`start`.

        Raises:
            RuntimeError: If :meth:`start` was not called.
        """
        if self._start is None:
            raise RuntimeError("Stopwatch.stop() called before start().")
        synchronize(self._device)
        elapsed = time.perf_counter() - self._start
        self._start = None
        return elapsed


@dataclass(frozen=True)
class MemoryReading:
    """Peak memory of a job.

    Attributes:
        kind: ``"cuda_max_memory_allocated"``, ``"cpu_job_peak_rss"`` or
            ``"cpu_process_max_rss"`` (see the module docstring).
        peak_mb: Peak in MiB.
        at_start_mb: The same quantity when the job started (CUDA: tensors alive
            before the job; CPU: the resident set, or for ``cpu_process_max_rss`` the
            process high-water mark, before the job).
    """

    kind: str
    peak_mb: float
    at_start_mb: float


def _max_rss_mb() -> float:
    """Process resident-set high-water mark in MiB (ru_maxrss is KiB on Linux)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024**2 if sys.platform == "darwin" else rss / 1024


def _proc_status_mb(field: str) -> float | None:
    """A ``/proc/self/status`` memory field (``VmHWM``, ``VmRSS``) in MiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the process's resident-set high-water mark (Linux), if allowed.

    Returns:
        Whether ``VmHWM`` was reset.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _proc_status_mb("VmHWM") is not None


class PeakMemory:
    """Track the peak memory of one job (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        """Reset the peak (CUDA; CPU on Linux) or record the process's peak so far.

        Args:
            device: The job's device.
        """
        self._device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self._kind = "cuda_max_memory_allocated"
            self._at_start = torch.cuda.memory_allocated(device) / 1024**2
        elif reset_peak_rss():
            self._kind = "cpu_job_peak_rss"
            self._at_start = _proc_status_mb("VmRSS") or 0.0
        else:
            self._kind = "cpu_process_max_rss"
            self._at_start = _max_rss_mb()

    def read(self) -> MemoryReading:
        """Return the peak so far."""
        if self._kind == "cuda_max_memory_allocated":
            peak = torch.cuda.max_memory_allocated(self._device) / 1024**2
        elif self._kind == "cpu_job_peak_rss":
            peak = _proc_status_mb("VmHWM") or math.nan
        else:
            peak = _max_rss_mb()
        return MemoryReading(self._kind, peak, self._at_start)
