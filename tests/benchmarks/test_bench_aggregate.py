"""Tuning and aggregation on hand-made results (the fields run_job writes)."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.aggregate import group_settings, mean_std, step_time_ratio, tune
from benchmarks.result import RunResult


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
