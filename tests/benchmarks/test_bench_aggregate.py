"""Tuning and aggregation on hand-made results (the fields run_job writes)."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.report.aggregate import (
    fastest_to_target,
    group_settings,
    mean_std,
    step_time_ratio,
    tune,
)
from benchmarks.sweep.result import RunResult


def result(optimizer, lr, seed, metric, status="ok", maximize=True, step=1e-3):
    """A minimal trained-run record."""
    return RunResult.from_json(
        {
            "problem": "p",
            "optimizer": optimizer,
            "seed": seed,
            "status": status,
            "hyperparameters": {"lr": lr},
            "maximize": maximize,
            "final": {"test_metric": metric if status == "ok" else None},
            "step_time": {"median": step},
        }
    )


def test_mean_std_is_sample_statistics():
    values = [0.1, 0.4, 0.35]
    assert mean_std(values) == (statistics.fmean(values), statistics.stdev(values))
    assert mean_std([2.0]) == (2.0, 0.0)
    assert all(math.isnan(v) for v in mean_std([]))


def test_tuning_maximizes_mean_and_flags_grid_edges():
    runs = [
        result("sgd", lr, seed, metric)
        for lr, metrics in {0.1: (0.5, 0.6), 0.3: (0.8, 0.7), 1.0: (0.9, 0.95)}.items()
        for seed, metric in enumerate(metrics)
    ]
    (choice,) = tune(group_settings(runs)).values()
    assert choice.best.hyperparameters == {"lr": 1.0}
    assert choice.grid == {"lr": [0.1, 0.3, 1.0]}
    assert choice.edges == {"lr": "max"}
    assert choice.best.final("test_metric") == mean_std([0.9, 0.95])


def test_tuning_ranks_settings_with_a_diverged_seed_last():
    runs = [
        result("sgd", 0.1, 0, 0.5),
        result("sgd", 0.1, 1, 0.5),
        result("sgd", 0.3, 0, 0.6),
        result("sgd", 0.3, 1, 0.6),
        result("sgd", 1.0, 0, 0.99),
        result("sgd", 1.0, 1, None, status="diverged"),
    ]
    (choice,) = tune(group_settings(runs)).values()
    assert choice.best.hyperparameters == {"lr": 0.3}
    assert choice.edges == {}


def test_tuning_minimizes_a_loss_metric():
    runs = [
        result("adam", lr, 0, loss, maximize=False)
        for lr, loss in ((0.01, 3.0), (0.03, 1.0), (0.1, 2.0))
    ]
    (choice,) = tune(group_settings(runs)).values()
    assert choice.best.hyperparameters == {"lr": 0.03}
    assert choice.edges == {}


def test_step_time_ratio_uses_medians_over_all_runs():
    runs = [result("sgd", 0.1, s, 0.5, step=t) for s, t in enumerate((1.0, 2.0, 9.0))]
    runs += [result("dn", 1.0, s, 0.5, step=t) for s, t in enumerate((10.0, 30.0))]
    settings = group_settings(runs)
    assert step_time_ratio(settings, "p", "dn") == pytest.approx(20.0 / 2.0)
    assert math.isnan(step_time_ratio(settings, "p", "adam"))


def reached(optimizer, lr, seed, steps, status="ok"):
    """A run that reached the only target (0.5) in ``steps`` (``None``: never)."""
    return RunResult.from_json(
        {
            "problem": "p",
            "optimizer": optimizer,
            "seed": seed,
            "status": status,
            "hyperparameters": {"lr": lr},
            "targets": [0.5],
            "steps_to_target": [steps],
            "time_to_target": [None if steps is None else steps / 100],
        }
    )


def test_fastest_to_target_is_each_seeds_fastest_grid_point_median_over_seeds():
    runs = [
        *(reached("sgd", 0.1, seed, s) for seed, s in enumerate((50, 95, None))),
        *(reached("sgd", 1.0, seed, s) for seed, s in enumerate((60, 70, 90))),
        reached("sgd", 3.0, 0, 10, status="diverged"),  # a diverged run never counts
    ]
    settings = group_settings(runs)
    steps = fastest_to_target(settings, "steps_to_target", 0)
    # per seed: min(50, 60) = 50, min(95, 70) = 70, min(None, 90) = 90; median 70
    assert steps.value == 70 and steps.setting.hyperparameters == {"lr": 1.0}
    assert (steps.seeds_reached, steps.seeds, steps.reached) == (3, 3, True)
    assert fastest_to_target(settings, "time_to_target", 0).value == 0.7


def test_fastest_to_target_takes_the_upper_median_and_misses_when_it_missed():
    two = [reached("adam", 0.1, 0, 40), reached("adam", 0.1, 1, 80)]
    assert fastest_to_target(group_settings(two), "steps_to_target", 0).value == 80
    missed = [reached("adam", 0.1, s, steps) for s, steps in enumerate((40, None))]
    fastest = fastest_to_target(group_settings(missed), "steps_to_target", 0)
    assert not fastest.reached and fastest.setting is None
    assert (fastest.seeds_reached, fastest.seeds) == (1, 2)
