"""Grid extension at the edge: the rule on hand-made results, and a real multirun."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.report.aggregate import group_settings, tune
from benchmarks.report.loading import load_results
from benchmarks.sweep.grid_extension import (
    FACTOR,
    extend_sweep,
    extensions,
    plan_round,
)
from benchmarks.sweep.result import RunResult

REPO = Path(__file__).resolve().parents[2]


def result(lr, seed, metric, status="ok", key="lr"):
    """A minimal trained-run record (what tune() reads)."""
    return RunResult.from_json(
        {
            "problem": "p",
            "optimizer": "sgd",
            "seed": seed,
            "status": status,
            "hyperparameters": {key: lr},
            "maximize": True,
            "final": {"test_metric": metric if status == "ok" else None},
        }
    )


def found(runs):
    return [
        (e.key, e.edge, e.value, e.new_value)
        for e in extensions(tune(group_settings(runs)))
    ]


def test_edge_value_gets_a_point_half_a_decade_beyond():
    at_min = [result(lr, 0, m) for lr, m in ((0.01, 0.9), (0.03, 0.8), (0.1, 0.7))]
    at_max = [result(lr, 0, m) for lr, m in ((0.01, 0.7), (0.03, 0.8), (0.1, 0.9))]
    inside = [result(lr, 0, m) for lr, m in ((0.01, 0.7), (0.03, 0.9), (0.1, 0.8))]
    assert found(at_min) == [("lr", "min", 0.01, pytest.approx(0.01 / 10**0.5))]
    assert found(at_max) == [("lr", "max", 0.1, pytest.approx(0.1 * 10**0.5))]
    assert found(inside) == []
    assert pytest.approx(10**0.5) == FACTOR


def test_no_extension_for_integer_negative_or_incomplete_grids():
    integers = [result(k, 0, m, key="criterion") for k, m in ((10, 0.7), (50, 0.9))]
    negative = [result(lr, 0, m) for lr, m in ((-1.0, 0.7), (0.1, 0.9))]
    diverged = [
        result(0.01, 0, 0.7),
        result(0.01, 1, None, status="diverged"),
        result(0.1, 0, None, status="diverged"),
    ]
    assert found(integers) == found(negative) == found(diverged) == []


def _written(tmp_path: Path, finals: dict[tuple[int, float], float], seeds: int):
    """Results of SGD on problem ``p`` in numbered job folders, one per run.

    ``finals`` maps ``(batch size, learning rate)`` to the final accuracy.
    """
    number = 0
    for (batch_size, lr), final in finals.items():
        for seed in range(seeds):
            run = result(lr, seed, final)
            run.config = {
                "problem": {"name": "p", "batch_size": batch_size},
                "optimizer": {"lr": lr},
                "seed": seed,
            }
            run.write(tmp_path / str(number))
            number += 1


def _planned(tmp_path: Path) -> list[tuple[int, float]]:
    return [
        (job.config["problem"]["batch_size"], job.config["optimizer"]["lr"])
        for job in plan_round(tmp_path, 1, 1)
    ]


def test_each_problem_setting_is_extended_at_its_own_edge(tmp_path):
    """A sweep over a problem setting is tuned per setting, as the report does."""
    finals = {(16, 0.1): 0.95, (16, 1.0): 0.9, (64, 0.1): 0.8, (64, 1.0): 0.96}
    _written(tmp_path, finals, seeds=2)
    assert sorted(_planned(tmp_path)) == [
        (16, pytest.approx(0.1 / FACTOR)),
        (16, pytest.approx(0.1 / FACTOR)),
        (64, pytest.approx(1.0 * FACTOR)),
        (64, pytest.approx(1.0 * FACTOR)),
    ]


def test_a_tie_is_broken_as_the_report_breaks_it(tmp_path):
    """Jobs 0–17: learning rates 0.03 (jobs 3–5) and 3 (jobs 15–17) tie at the top.

    The report tunes in job order (2 before 10) and keeps the first, 0.03, inside
    the grid: nothing to extend (in text order, 15–17 came before 3–5: 3 was tuned
    and extended).
    """
    lrs = {0.01: 0.5, 0.03: 0.9, 0.1: 0.8, 0.3: 0.7, 1.0: 0.6, 3.0: 0.9}
    _written(tmp_path, {(8, lr): final for lr, final in lrs.items()}, seeds=3)
    tuned = tune(group_settings(load_results(tmp_path)))[("p", "sgd")]
    assert tuned.best.hyperparameters["lr"] == 0.03
    assert _planned(tmp_path) == []


def test_zero_rounds_run_nothing(tmp_path):
    assert extend_sweep(tmp_path, rounds=0) == 0


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Multirun of SGD on digits_logreg, lr ∈ {1e-5, 0.1}, 2 seeds, 6 steps.

    0.1 wins at the max edge (1e-5 stays at chance level: diverged), so two extension
    rounds add 0.316 and 1 (each better than the last) on both seeds.
    """
    sweep_dir = tmp_path_factory.mktemp("extension")
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
        "num_threads=1",
        "optimizer=sgd",
        "optimizer.lr=0.00001,0.1",
        "seed=0,1",
    ]
    process = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return sweep_dir, process


@pytest.mark.slow
def test_extension_jobs_run_on_every_seed_in_new_numbered_dirs(sweep):
    sweep_dir, process = sweep
    jobs = {int(p.parent.name): p for p in sweep_dir.glob("*/result.json")}
    assert sorted(jobs) == list(range(8)), "4 sweep jobs + 2 rounds × 2 seeds"
    added = {n: json.loads(jobs[n].read_text()) for n in range(4, 8)}
    for number, (round_, lr, edge_value) in {
        4: (1, 0.1 * FACTOR, 0.1),
        5: (1, 0.1 * FACTOR, 0.1),
        6: (2, 0.1 * FACTOR**2, 0.1 * FACTOR),
        7: (2, 0.1 * FACTOR**2, 0.1 * FACTOR),
    }.items():
        r = added[number]
        assert r["status"] == "ok" and r["hyperparameters"] == {"lr": lr}
        assert r["config"]["extended_from"] == {
            "key": "lr",
            "edge": "max",
            "value": edge_value,
            "round": round_,
        }
        assert r["config"]["problem"]["steps"] == 6, "the sweep's overrides are kept"
    assert {added[n]["seed"] for n in (4, 5)} == {added[n]["seed"] for n in (6, 7)}
    assert {added[4]["seed"], added[5]["seed"]} == {0, 1}
    assert "grid extension 1/2: digits_logreg sgd lr=0.1 is the max" in process.stderr
    assert "[extension job 7] digits_logreg sgd lr=1 seed=" in process.stderr


@pytest.mark.slow
def test_report_includes_and_marks_extended_points(sweep):
    sweep_dir, _ = sweep
    (choice,) = tune(group_settings(load_results(sweep_dir))).values()
    assert choice.best.hyperparameters["lr"] == pytest.approx(1.0)
    assert choice.edges == {"lr": "max"}, "still on the edge after the last round"
    markdown = (sweep_dir / "report" / "summary.md").read_text()
    assert "| sgd | lr=1 ⚠ max of grid (extended from edge) | 2/2 |" in markdown
    assert (
        "lr ∈ {1e-05, 0.1, 0.316228 (extended from edge), 1 (extended from edge)}"
        in markdown
    )
    with open(sweep_dir / "report" / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8
    extended = [json.loads(r["extended_from"]) for r in rows]
    assert sum(e is not None for e in extended) == 4


@pytest.mark.slow
def test_report_counts_diverged_seeds_with_reasons(sweep):
    sweep_dir, _ = sweep
    markdown = (sweep_dir / "report" / "summary.md").read_text()
    (line,) = [x for x in markdown.splitlines() if x.startswith("- sgd lr=1e-05:")]
    assert line.startswith("- sgd lr=1e-05: 2/2 seed(s) diverged (seed 0: final test")
    assert "seed 1: final test accuracy" in line
    with open(sweep_dir / "report" / "runs.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "diverged"]
    assert len(rows) == 2
    assert all(r["divergence"].startswith("final test accuracy") for r in rows)
    assert all(math.isfinite(float(r["best_test_metric"])) for r in rows)
