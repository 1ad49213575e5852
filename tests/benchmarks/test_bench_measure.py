"""Peak memory per job: the CPU reading is reset at the start of every job."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks.measure import PeakMemory, reset_peak_rss

CPU = torch.device("cpu")


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not reset_peak_rss(),
    reason="VmHWM reset (/proc/self/clear_refs) needs Linux",
)
def test_cpu_peak_is_per_job_not_cumulative():
    first = PeakMemory(CPU)
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    del big
    earlier = first.read()
    assert earlier.kind == "cpu_job_peak_rss"
    assert earlier.peak_mb >= earlier.at_start_mb + 200
    second = PeakMemory(CPU)  # the next job of a sequential multirun
    small = torch.ones(2**20)  # 4 MiB
    reading = second.read()
    del small
    assert reading.peak_mb < earlier.peak_mb - 150, "the first job's peak is gone"
    assert reading.peak_mb >= reading.at_start_mb
