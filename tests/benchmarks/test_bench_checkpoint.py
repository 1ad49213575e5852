"""A job killed after a checkpoint resumes from it to the uninterrupted run's result."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sweep.checkpointing import CHECKPOINT_FILE, Checkpointing
from benchmarks.sweep.result import RESULT_FILE, RunResult

pytestmark = pytest.mark.slow  # three runs in subprocesses

REPO = Path(__file__).resolve().parents[2]
JOB = [
    "problem=digits_mlp",
    "optimizer=dampednewton",  # Monte-Carlo GGN: its generator must resume too
    "problem.steps=8",
    "problem.eval_every=2",
    "device=cpu",
    "seed=3",
]
KILL_AT = 6
"""The second checkpoint (every 3 steps): it replaced the first one."""


def run_job(job_dir: Path, *extra: str, kill_at: int | None = None):
    module = ["benchmarks.run"]
    if kill_at is not None:
        module = ["tests.benchmarks.killed_after_checkpoint", str(kill_at)]
    return subprocess.run(
        [sys.executable, "-m", *module, *JOB, f"hydra.run.dir={job_dir}", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "schedule", [[], ["lr_schedule=linear"]], ids=["constant", "linear_schedule"]
)
def test_killed_job_resumes_bit_identically_from_its_checkpoint(tmp_path, schedule):
    reference = run_job(tmp_path / "reference", *schedule)
    assert reference.returncode == 0, reference.stderr
    killed = run_job(tmp_path / "job", "checkpoint_every=3", *schedule, kill_at=KILL_AT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (tmp_path / "job" / CHECKPOINT_FILE).exists()
    assert not (tmp_path / "job" / RESULT_FILE).exists()

    resumed = run_job(tmp_path / "job", "checkpoint_every=3", *schedule)

    assert resumed.returncode == 0, resumed.stderr
    expected = RunResult.read(tmp_path / "reference" / RESULT_FILE)
    actual = RunResult.read(tmp_path / "job" / RESULT_FILE)
    assert actual.resumed_from_step == KILL_AT
    assert expected.resumed_from_step is None
    assert actual.status == expected.status == "ok"
    assert actual.curves is not None and expected.curves is not None
    assert actual.curves.step == expected.curves.step == [0, 2, 4, 6, 8]
    for name in ("train_loss", "test_loss", "test_metric"):
        assert getattr(actual.curves, name) == getattr(expected.curves, name), name
    assert actual.final == expected.final
    assert actual.steps_taken == expected.steps_taken == 8
    assert not (tmp_path / "job" / CHECKPOINT_FILE).exists(), "removed when done"


def test_checkpoint_every_must_be_a_positive_integer(tmp_path):
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="checkpoint_every must be"):
            Checkpointing(tmp_path, bad, {})  # type: ignore[arg-type]
