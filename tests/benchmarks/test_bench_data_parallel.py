"""A benchmark job data-parallel under ``torchrun``: shards; the one-process run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.report.report import write_report
from benchmarks.sweep.data_parallel import DataParallel
from benchmarks.sweep.result import RESULT_FILE, RunResult

REPO = Path(__file__).resolve().parents[2]
JOB = [
    "problem=digits_logreg",
    "optimizer=dampednewton",
    "optimizer.mc_samples=0",  # exact GGN: Monte-Carlo labels differ per rank
    "dtype=float64",
    "problem.steps=12",
    "problem.eval_every=6",
]


def test_shards_are_contiguous_in_rank_order():
    index = torch.arange(12)
    shards = [DataParallel(rank, 3).shard(index) for rank in range(3)]
    assert torch.equal(torch.cat(shards), index)
    assert all(shard.shape == (4,) for shard in shards)


def test_global_batch_not_divisible_by_world_size_is_refused():
    with pytest.raises(ValueError, match=r"batch_size=10 .* world size 4"):
        DataParallel(0, 4).check_batch_size(10)
    with pytest.raises(ValueError, match="rank must lie"):
        DataParallel(2, 2)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
GRACE = ["--monitor-interval", "5"]
"""torchrun terminates the other ranks within its monitor interval of a rank's exit
(0.1 s by default): a failed job's rank 0 needs longer on a busy machine to write its
``result.json`` and say why it ends (docs/distributed.md)."""


def _launch(
    command: list[str], timeout: float, **extra_env: str
) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository, outside any enclosing process group."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra_env}
    return subprocess.run(
        command,
        cwd=REPO,
        env={k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _run(command: list[str], job_dir: Path) -> RunResult:
    """Run ``benchmarks.run`` with ``command`` as launcher; its ``result.json``."""
    completed = _launch(
        [*command, "-m", "benchmarks.run", *JOB, f"hydra.run.dir={job_dir}"], 300
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return RunResult.read(job_dir / RESULT_FILE)


@pytest.mark.slow
def test_two_processes_train_like_one_on_the_same_global_batch(tmp_path):
    """``torchrun --nproc-per-node 2`` trains the one-process run's model.

    Each rank takes half of every global batch of 64; DDP averages the gradients and
    DampedNewton gathers the BackPACK buffers, so the step is the global batch's.
    In float64 the only differences are summation orders (gradient all-reduce,
    gathered Gram blocks), ~1e-15 relative per step, hence the 1e-9 tolerance over
    12 steps; the test accuracy is equal.
    """
    two = _run([*TORCHRUN, "--nproc-per-node", "2"], tmp_path / "two")
    one = _run([sys.executable], tmp_path / "one")
    assert (two.status, one.status) == ("ok", "ok")
    assert (two.world_size, one.world_size) == (2, 1)
    assert two.communication_per_step is not None and two.communication_per_step > 0
    assert one.communication_per_step is None
    assert two.final is not None and one.final is not None
    assert two.final.train_loss == pytest.approx(one.final.train_loss, rel=1e-9)
    assert two.final.test_loss == pytest.approx(one.final.test_loss, rel=1e-9)
    assert two.final.test_metric == one.final.test_metric
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        ".hydra",
        RESULT_FILE,
        "run.log",
    ]
    report = write_report(tmp_path)["markdown"].read_text()
    assert "| world size | comm ms/step |" in report
    assert "| 1/2 |" in report


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_failing_rank_stops_every_rank_of_a_torchrun_multirun(mode, tmp_path):
    """Rank 1 raises (or hangs) at its third step of the first of two jobs.

    The failed rank ends its process instead of going on to the next job (where it
    would wait for rank 0 forever); rank 0's collective fails, at once when rank 1
    exited ("Connection closed by peer"), after ``data_parallel.timeout_s`` when it
    hangs; rank 0 records the failure and ends too, and torchrun stops everything.
    """
    script = Path(__file__).with_name("failing_rank.py")
    command = [
        *(*TORCHRUN, *GRACE, "--nproc-per-node", "2", str(script), "--multirun"),
        *JOB,
        *("seed=0,1", "data_parallel.timeout_s=5", f"hydra.sweep.dir={tmp_path}"),
    ]
    start = time.perf_counter()
    completed = _launch(command, 120, FAILING_RANK_MODE=mode)
    elapsed = time.perf_counter() - start
    assert completed.returncode != 0
    assert elapsed < 90, "rank 0 waited for the failed rank"
    first = RunResult.read(tmp_path / "0" / RESULT_FILE)
    assert first.status == "failed"
    assert first.error is not None
    expected = r"Connection (closed|reset) by peer" if mode == "raise" else "timeout"
    assert re.search(expected, first.error), first.error
    assert "[rank 0 of 2 under torchrun: a collective fails" in first.error
    assert not (tmp_path / "1" / RESULT_FILE).exists()
    assert "rank 0 of 2: the job failed" in completed.stderr
    if mode == "raise":
        assert "rank 1 of 2: the job failed (RuntimeError: injected" in completed.stderr


@pytest.mark.slow
def test_a_killed_rank_stops_every_rank_of_a_torchrun_multirun(tmp_path):
    """Rank 1 is killed (SIGKILL, no clean-up) at its third step of the first job.

    Rank 0's collective fails at once ("Connection closed/reset by peer"), within
    ``data_parallel.timeout_s``; torchrun names the killed rank as the root cause
    and stops rank 0 (SIGTERM), possibly before rank 0 recorded the failure: its
    ``result.json``, if written, is complete (atomic) and says why.
    """
    script = Path(__file__).with_name("failing_rank.py")
    command = [
        *(*TORCHRUN, *GRACE, "--nproc-per-node", "2", str(script), "--multirun"),
        *JOB,
        *("seed=0,1", "data_parallel.timeout_s=60", f"hydra.sweep.dir={tmp_path}"),
    ]
    start = time.perf_counter()
    completed = _launch(command, 120, FAILING_RANK_MODE="kill")
    elapsed = time.perf_counter() - start
    assert completed.returncode != 0
    assert elapsed < 60, "rank 0 waited out the timeout for the killed rank"
    assert re.search(
        r"rank\s*: 1 \(local_rank: 1\)\n\s*exitcode\s*: -9 .*\(SIGKILL\)",
        completed.stderr,
    ), completed.stderr
    if (tmp_path / "0" / RESULT_FILE).exists():
        first = RunResult.read(tmp_path / "0" / RESULT_FILE)
        assert first.status == "failed" and first.error is not None
        # gloo says "closed" or "reset" by peer, depending on where the read broke.
        assert re.search(r"Connection (closed|reset) by peer", first.error), first.error
        assert "[rank 0 of 2 under torchrun: a collective fails" in first.error
    assert not (tmp_path / "1" / RESULT_FILE).exists()


@pytest.mark.slow
def test_torchrun_multirun_extends_its_grid_on_every_rank(tmp_path):
    """SGD on lr ∈ {1e-5, 0.1}: 0.1 wins at the edge; all ranks run lr=0.316."""
    command = [
        *(*TORCHRUN, "--nproc-per-node", "2", "-m", "benchmarks.run", "--multirun"),
        *("problem=digits_logreg", "problem.steps=6", "problem.eval_every=3"),
        *("optimizer=sgd", "optimizer.lr=0.00001,0.1", "grid_extension.rounds=1"),
        f"hydra.sweep.dir={tmp_path}",
    ]
    completed = _launch(command, 300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    extended = RunResult.read(tmp_path / "2" / RESULT_FILE)
    assert (extended.status, extended.world_size) == ("ok", 2)
    assert extended.hyperparameters == {"lr": pytest.approx(0.1 * 10**0.5)}
    assert completed.stderr.count("grid extension 1/1: digits_logreg sgd lr=0.1") == 1
    assert completed.stderr.count("2 jobs (2 sgd on digits_logreg)") == 1, "rank 0"
    assert (tmp_path / "report" / "summary.md").is_file()
