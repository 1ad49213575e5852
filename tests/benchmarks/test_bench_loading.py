"""Reading a sweep: job order, damaged files, skipped jobs, problems told apart."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from benchmarks.report.aggregate import group_settings
from benchmarks.report.loading import distinguish_protocols, load_results
from benchmarks.sweep.result import RunResult
from tests.benchmarks.made_results import made_result


def _with_config(result: RunResult, batch_size: int, threads: int = 1) -> RunResult:
    config = {
        "problem": {"name": "p", "batch_size": batch_size, "model": {"width": 8}},
        "dtype": "float32",
        "device": "cpu",
        "num_threads": threads,
    }
    return dataclasses.replace(result, config=config)


def _write(sweep: Path, job: str, result: RunResult) -> Path:
    folder = sweep / job
    folder.mkdir(parents=True)
    return result.write(folder)


def test_runs_of_other_problem_settings_are_not_seeds_of_one_setting():
    """``problem.batch_size=8,256``: two problems, each with its own setting."""
    runs = [
        _with_config(made_result("sgd", 0, [10, 20]), batch_size=8),
        _with_config(made_result("sgd", 0, [30, 40]), batch_size=256),
    ]

    named = distinguish_protocols(runs)

    assert [r.problem for r in named] == ["p (batch_size=8)", "p (batch_size=256)"]
    settings = group_settings(named)
    assert [len(s.runs) for s in settings] == [1, 1]


def test_runs_of_one_protocol_keep_their_problems_name():
    runs = [
        _with_config(made_result("sgd", seed, [10, 20]), batch_size=8)
        for seed in range(3)
    ]
    assert [r.problem for r in distinguish_protocols(runs)] == ["p"] * 3
    assert [len(s.runs) for s in group_settings(runs)] == [3]


def test_the_machines_settings_tell_runs_apart_too():
    runs = [
        _with_config(made_result("sgd", 0, [10, 20]), batch_size=8, threads=threads)
        for threads in (1, 2)
    ]
    assert [r.problem for r in distinguish_protocols(runs)] == [
        "p (num_threads=1)",
        "p (num_threads=2)",
    ]


def test_results_load_in_job_order_and_a_damaged_file_is_named(tmp_path):
    for job in (2, 10, 1):
        _write(tmp_path, str(job), made_result("sgd", job, [10, 20]))
    damaged = _write(tmp_path, "3", made_result("adam", 3, [10, 20]))
    damaged.write_text(damaged.read_text()[:20])

    with pytest.warns(UserWarning, match=rf"Left out {damaged}, which is damaged"):
        results = load_results(tmp_path)

    assert [r.seed for r in results] == [1, 2, 10]


def test_a_sweep_whose_jobs_were_all_skipped_says_why(tmp_path):
    skipped = dataclasses.replace(
        made_result("sgd", 0, [None, None]),
        status="skipped",
        skip_reason="damping=lm applies to dampednewton only",
    )
    _write(tmp_path, "0", skipped)

    with pytest.raises(FileNotFoundError, match=r"No job .* ran.*damping=lm applies"):
        load_results(tmp_path)
