"""Interrupted sweeps: no half-written result, and a rerun runs only what is missing.

A sweep is signalled half-way through writing one job's ``result.json``
(``interrupted_sweep.py``); then the same command runs again into the same
``hydra.sweep.dir``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from benchmarks.sweep.result import RESULT_FILE, RunResult

pytestmark = pytest.mark.slow  # multiruns in subprocesses

REPO = Path(__file__).resolve().parents[2]
LEARNING_RATES = ("0.05", "0.1", "0.2")
SEEDS = ("0", "1")
NUM_JOBS = len(LEARNING_RATES) * len(SEEDS)
SIGNAL_AT = 4
"""The 4th result is being written when the signal comes: jobs 0-2 are done."""


def sweep_command(sweep_dir: Path, *extra: str) -> list[str]:
    """The multirun of tiny SGD jobs (grid extension off unless ``extra`` sets it)."""
    return [
        f"hydra.sweep.dir={sweep_dir}",
        "problem=digits_logreg",
        "problem.steps=4",
        "problem.eval_every=2",
        "device=cpu",
        "optimizer=sgd",
        f"optimizer.lr={','.join(LEARNING_RATES)}",
        f"seed={','.join(SEEDS)}",
        "grid_extension.rounds=0",
        *extra,
    ]


def run_sweep(
    args: list[str], signum: str | None = None
) -> subprocess.CompletedProcess:
    """The real command line, or the one that signals itself at the 4th write."""
    module = ["benchmarks.run"]
    if signum is not None:
        module = ["tests.benchmarks.interrupted_sweep", signum, str(SIGNAL_AT)]
    return subprocess.run(
        [sys.executable, "-m", *module, "--multirun", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def result_files(sweep_dir: Path) -> dict[int, Path]:
    return {int(p.parent.name): p for p in sweep_dir.glob(f"*/{RESULT_FILE}")}


def assert_complete_and_valid(path: Path) -> RunResult:
    """Parses, finished training, and records the overrides of its job directory."""
    result = RunResult.read(path)  # a cut-off file raises JSONDecodeError here
    assert result.status == "ok", result.error
    overrides = OmegaConf.load(path.parent / ".hydra" / "overrides.yaml")
    assert result.overrides == list(overrides)
    assert f"optimizer.lr={result.hyperparameters['lr']}" in result.overrides
    return result


@pytest.fixture(scope="module")
def terminated_sweep(tmp_path_factory) -> Path:
    """A sweep that received SIGTERM while writing its 4th result."""
    sweep_dir = tmp_path_factory.mktemp("terminated")
    process = run_sweep(sweep_command(sweep_dir), "SIGTERM")
    assert process.returncode == -signal.SIGTERM, process.stderr
    return sweep_dir


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_signal_during_a_sweep_leaves_no_half_written_result(
    signum: str, terminated_sweep: Path, tmp_path: Path
):
    if signum == "SIGTERM":
        sweep_dir = terminated_sweep
    else:
        sweep_dir = tmp_path
        process = run_sweep(sweep_command(sweep_dir), signum)
        assert process.returncode != 0
        assert "KeyboardInterrupt" in process.stderr or process.returncode < 0
    files = result_files(sweep_dir)
    assert sorted(files) == list(range(SIGNAL_AT - 1)), "the earlier jobs finished"
    for path in files.values():
        assert_complete_and_valid(path)


def test_rerun_runs_only_the_missing_and_damaged_jobs(terminated_sweep, tmp_path):
    sweep_dir = tmp_path / "sweep"
    subprocess.run(["cp", "-r", str(terminated_sweep), str(sweep_dir)], check=True)
    files = result_files(sweep_dir)
    files[0].unlink()  # deleted
    text = files[1].read_text()
    files[1].write_text(text[: len(text) // 2])  # cut off
    kept = files[2].stat()

    process = run_sweep(sweep_command(sweep_dir))

    assert process.returncode == 0, process.stderr
    assert process.stderr.count("already done") == 1
    (line,) = [line for line in process.stderr.splitlines() if "already done" in line]
    assert line.startswith(f"[3/{NUM_JOBS}] digits_logreg sgd"), line
    after = result_files(sweep_dir)
    assert sorted(after) == list(range(NUM_JOBS))
    for path in after.values():
        assert_complete_and_valid(path)
    unchanged = after[2].stat()
    assert (unchanged.st_ino, unchanged.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
    for number in set(after) - {2}:
        assert after[number].stat().st_mtime_ns > kept.st_mtime_ns, number
    assert "Report folder:" in process.stdout


def test_rerun_extends_the_grid_as_if_the_sweep_had_never_stopped(tmp_path):
    """The extension job's result is lost: the rerun plans it again, same folder."""
    args = [
        *sweep_command(tmp_path, "optimizer.lr=0.01,0.03", "seed=0"),
        "grid_extension.rounds=1",  # the last of a key counts
    ]
    first = run_sweep(args)
    assert first.returncode == 0, first.stderr
    assert "grid extension 1/1: digits_logreg sgd lr=0.03 is the max" in first.stderr
    files = result_files(tmp_path)
    assert RunResult.read(files[2]).extended_from == {
        "key": "lr",
        "edge": "max",
        "value": 0.03,
        "round": 1,
    }
    files[2].unlink()
    text = files[0].read_text()
    files[0].write_text(text[: len(text) // 3])
    kept = files[1].stat()

    second = run_sweep(args)

    assert second.returncode == 0, second.stderr
    assert second.stderr.count("already done") == 1
    assert "grid extension 1/1: digits_logreg sgd lr=0.03 is the max" in second.stderr
    after = result_files(tmp_path)
    assert sorted(after) == [0, 1, 2], "the extension job reran in its own folder"
    assert RunResult.read(after[2]).extended_from["round"] == 1
    assert after[1].stat().st_mtime_ns == kept.st_mtime_ns
    assert "optimizer.lr=0.01" in RunResult.read(after[0]).overrides  # reran
