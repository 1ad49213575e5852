"""Tiny runs through the real command line: results, progress, report, exit status."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.report.report import main as report_main

pytestmark = pytest.mark.slow  # runs a sweep and the run script in subprocesses

REPO = Path(__file__).resolve().parents[2]
OPTIMIZERS = ("sgd", "adam")
LEARNING_RATES = ("0.1", "-1")  # -1 makes the optimizer constructor raise
NUM_JOBS = len(OPTIMIZERS) * len(LEARNING_RATES)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Run 2 optimizers × 2 learning rates (one invalid) × 1 seed on digits_logreg."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    command = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--multirun",
        f"hydra.sweep.dir={sweep_dir}",
        "problem=digits_logreg",
        "problem.steps=6",
        "problem.eval_every=3",
        "device=cpu",
        f"optimizer={','.join(OPTIMIZERS)}",
        f"optimizer.lr={','.join(LEARNING_RATES)}",
    ]
    process = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 1, "a failed job fails the sweep\n" + process.stderr
    return sweep_dir, process


def test_every_job_wrote_its_result(sweep):
    sweep_dir, _ = sweep
    results = [
        json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/result.json"))
    ]
    assert len(results) == NUM_JOBS
    by_status = {}
    for r in results:
        by_status.setdefault(r["status"], []).append(r)
    assert len(by_status["ok"]) == len(OPTIMIZERS), "valid jobs must succeed"
    assert len(by_status["failed"]) == len(OPTIMIZERS), "invalid lr must fail"
    for r in by_status["failed"]:
        assert "Invalid learning rate" in r["error"]
    for r in by_status["ok"]:
        assert r["curves"]["step"] == [0, 3, 6]
        assert r["hyperparameters"] == {"lr": 0.1}


def test_progress_lines_per_job(sweep):
    _, process = sweep
    plan = "4 jobs (2 sgd on digits_logreg, 2 adam on digits_logreg): about "
    assert plan in process.stderr.splitlines()[0], "the expected time comes first"
    assert "ETA " in process.stderr
    for k in range(1, NUM_JOBS + 1):
        assert f"[{k}/{NUM_JOBS}] digits_logreg" in process.stderr
    assert "FAILED ValueError: Invalid learning rate" in process.stderr
    assert "final test accuracy" in process.stderr


def test_failed_jobs_are_listed_after_the_report(sweep):
    sweep_dir, process = sweep
    assert "Report folder:" in process.stdout, "the report is written all the same"
    failed = sorted(
        str(path.resolve())
        for path in sweep_dir.glob("*/result.json")
        if json.loads(path.read_text())["status"] == "failed"
    )
    assert len(failed) == len(OPTIMIZERS)
    listing = process.stderr.split(f"{len(failed)} job(s) failed", 1)[1]
    assert sorted(listing.split()[-len(failed) :]) == failed
    for path in failed:  # the progress line of the job names its result too
        assert f"(traceback: {path})" in process.stderr


def _single_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "benchmarks.run",
        f"hydra.run.dir={tmp_path}",
        "problem=digits_logreg",
        "problem.steps=2",
        "problem.eval_every=1",
        "device=cpu",
        *overrides,
    ]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_failed_single_run_exits_1_and_names_its_result(tmp_path):
    process = _single_run(tmp_path, "optimizer.lr=-1")
    assert process.returncode == 1
    result_file = tmp_path / "result.json"
    assert json.loads(result_file.read_text())["status"] == "failed"
    output = process.stdout + process.stderr
    assert "FAILED ValueError: Invalid learning rate" in output
    assert f"(traceback: {result_file.resolve()})" in output


def test_successful_single_run_exits_0_and_names_its_result(tmp_path):
    process = _single_run(tmp_path, "optimizer.lr=0.1")
    assert process.returncode == 0, process.stderr
    assert f"Result: {(tmp_path / 'result.json').resolve()}" in process.stdout


def test_report_files(sweep):
    sweep_dir, process = sweep
    report = sweep_dir / "report"
    assert str(report.resolve()) in process.stdout, "the report location is printed"
    with open(report / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == NUM_JOBS
    assert {r["optimizer"] for r in rows} == set(OPTIMIZERS)
    markdown = (report / "summary.md").read_text()
    assert "## digits_logreg" in markdown
    assert "| optimizer | tuned |" in markdown
    for optimizer in OPTIMIZERS:
        assert f"\n| {optimizer} | " in markdown
    for name in ("curves_digits_logreg", "sensitivity_digits_logreg_lr", "step_cost"):
        png = report / f"{name}.png"
        assert png.stat().st_size > 1000, f"{png} is empty"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_script_regenerates(sweep, capsys):
    sweep_dir, _ = sweep
    csv_file = sweep_dir / "report" / "runs.csv"
    csv_file.unlink()
    report_main([str(sweep_dir)])
    assert csv_file.is_file()
    assert "Report folder:" in capsys.readouterr().out


@pytest.mark.parametrize("missing", ["no_such_dir", "empty_dir"])
def test_report_script_without_results_says_so_and_exits_2(tmp_path, missing):
    sweep_dir = tmp_path / missing
    if missing == "empty_dir":
        sweep_dir.mkdir()
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.report", str(sweep_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2
    assert "Traceback" not in process.stderr
    expected = "is not a directory" if missing == "no_such_dir" else "No result.json"
    assert "python -m benchmarks.report: error:" in process.stderr
    assert expected in process.stderr
