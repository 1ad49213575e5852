"""Report plots on hand-made results: bands, axes, titles, flat curves, no timings."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from benchmarks.report.aggregate import group_settings, tune
from benchmarks.report.loading import load_results
from benchmarks.report.plots import (
    curves_figure,
    seed_band,
    sensitivity_figure,
    step_cost_figure,
)
from benchmarks.report.report import write_report
from benchmarks.sweep.result import FinalMetrics, RunResult

LM = "dampednewton.LevenbergMarquardt"


def result(optimizer, hyperparameters, seed, final, metric="loss", curve=None):
    """A trained run on ``noisy_quadratic`` (a loss metric: lower is better)."""
    curve = curve or [100.0, 10.0, final]
    return RunResult.from_json(
        {
            "problem": "noisy_quadratic",
            "optimizer": optimizer,
            "seed": seed,
            "status": "ok",
            "hyperparameters": hyperparameters,
            "maximize": metric != "loss",
            "metric": metric,
            "targets": [],
            "final": {"test_metric": final},
            "curves": {
                "step": [0, 5, 10],
                "time": [0.0, 0.1, 0.2],
                "test_metric": curve,
            },
            "step_time": {"median": 1e-3},
        }
    )


def tuned_on(runs):
    return {optimizer: t for (_, optimizer), t in tune(group_settings(runs)).items()}


def test_log_band_is_the_geometric_mean_and_std_and_stays_positive():
    values = np.array([[1.0, 3.0], [100.0, 4.0], [10.0, np.nan]])
    center, low, high = seed_band(values, log=True)
    logs = [math.log(v) for v in (1.0, 100.0, 10.0)]
    mean, std = statistics.fmean(logs), statistics.stdev(logs)
    assert center[0] == pytest.approx(math.exp(mean), rel=1e-14)
    assert low[0] == pytest.approx(math.exp(mean - std), rel=1e-14)
    assert high[0] == pytest.approx(math.exp(mean + std), rel=1e-14)
    assert np.all(low > 0)
    # the arithmetic band of the first column would reach below zero
    assert statistics.fmean((1, 100, 10)) - statistics.stdev((1, 100, 10)) < 0


def test_linear_band_is_the_mean_and_sample_std_over_finite_seeds():
    values = np.array([[0.5, 0.9], [0.7, np.nan], [0.6, np.nan]])
    center, low, high = seed_band(values, log=False)
    mean, std = statistics.fmean((0.5, 0.7, 0.6)), statistics.stdev((0.5, 0.7, 0.6))
    assert (center[0], low[0], high[0]) == pytest.approx(
        (mean, mean - std, mean + std), rel=1e-14
    )
    assert (center[1], low[1], high[1]) == (0.9, 0.9, 0.9), "one seed: no spread"


def test_loss_curves_draw_positive_bands_on_the_log_axis():
    runs = [
        result("sgd", {"lr": 0.1}, seed, final, curve=[100.0, value, final])
        for seed, (value, final) in enumerate(((1.0, 0.5), (200.0, 50.0)))
    ]
    figure = curves_figure("noisy_quadratic", tuned_on(runs))
    steps_axis, time_axis = figure.axes
    assert steps_axis.get_yscale() == "log" and time_axis.get_xscale() == "log"
    for axis in (steps_axis, time_axis):
        (band,) = axis.collections
        heights = band.get_paths()[0].vertices[:, 1]
        assert np.all(np.isfinite(heights)) and np.all(heights > 0)


def test_sensitivity_title_fits_the_figure():
    runs = [
        result("dampednewton_lm", {"damping.value": value, "lr": 1.0}, 0, 1.0 + value)
        for value in (10.0, 100.0)
    ]
    figure = sensitivity_figure("noisy_quadratic", "damping.value", tuned_on(runs))
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    title = figure.axes[0].title.get_window_extent(canvas.get_renderer())
    assert figure.bbox.x0 <= title.x0 and title.x1 <= figure.bbox.x1
    assert title.y1 <= figure.bbox.y1


@pytest.mark.parametrize(
    ("key", "values", "scale"),
    [
        ("damping.z", [1.0, 2.0, 3.0, 4.0], "linear"),
        ("lr", [0.001, 0.003, 0.01, 0.03], "log"),
    ],
)
def test_sensitivity_axis_is_log_only_for_grids_spanning_a_decade(key, values, scale):
    runs = [
        result("dampednewton_noise", {key: v}, seed, 1.0 + v + seed)
        for v in values
        for seed in range(2)
    ]
    axis = sensitivity_figure("noisy_quadratic", key, tuned_on(runs)).axes[0]
    assert axis.get_xscale() == scale
    assert [t.get_text() for t in axis.get_xticklabels()] == [f"{v:g}" for v in values]
    assert list(axis.lines[0].get_xdata()) == values


def _notes(figure):
    return [text.get_text() for text in figure.axes[0].texts]


def test_flat_levenberg_marquardt_sensitivity_says_why():
    runs = [
        result(
            "dampednewton_lm",
            {"damping._target_": LM, "damping.value": value},
            seed,
            final * (1 + 1e-7 * index),  # float32 noise of equal runs
        )
        for index, value in enumerate((10.0, 100.0, 1000.0))
        for seed, final in enumerate((13.54, 7.32))
    ]
    (note,) = _notes(
        sensitivity_figure("noisy_quadratic", "damping.value", tuned_on(runs))
    )
    flat = " ".join(note.split())
    assert "Flat: the final test loss does not depend on damping.value" in flat
    assert "Levenberg-Marquardt only starts from this δ" in flat


def test_a_curve_that_varies_gets_no_flat_note():
    runs = [
        result("dampednewton_noise", {"damping.z": z}, 0, 3.0 + z) for z in (1.0, 2.0)
    ]
    assert not _notes(
        sensitivity_figure("noisy_quadratic", "damping.z", tuned_on(runs))
    )


def test_step_cost_without_any_timing_draws_a_note():
    failed = {
        "problem": "p",
        "optimizer": "sgd",
        "seed": 0,
        "status": "failed",
        "hyperparameters": {"lr": -1},
    }
    figure = step_cost_figure(group_settings([RunResult.from_json(failed)]))
    FigureCanvasAgg(figure).draw()
    assert _notes(figure) == ["no run was timed"]


def test_report_of_a_sweep_whose_jobs_all_failed(tmp_path):
    for number, lr in enumerate((-1, -2)):
        job = tmp_path / str(number)
        job.mkdir()
        failed = {
            "problem": "digits_logreg",
            "optimizer": "sgd",
            "seed": 0,
            "status": "failed",
            "error": f"ValueError: Invalid learning rate: {lr}",
            "grid_point": {},
            "hyperparameters": {"lr": lr},
            "config": {"problem": {"name": "digits_logreg"}},
        }
        (job / "result.json").write_text(json.dumps(failed))
    paths = write_report(tmp_path)
    assert "| sgd | " in paths["markdown"].read_text()
    for name in ("curves_digits_logreg", "sensitivity_digits_logreg_lr", "step_cost"):
        assert paths[name].read_bytes()[:4] == b"\x89PNG"


def test_a_setting_varied_over_lists_gets_no_sensitivity_plot(tmp_path):
    """Muon's betas as a grid of pairs: the report plots the numbers only."""
    for number, (betas, lr) in enumerate(
        (b, lr) for b in ([0.9, 0.95], [0.9, 0.999]) for lr in (0.01, 0.1)
    ):
        final = 1.0 + lr + betas[1]
        run = result("muon", {"adamw_betas": betas, "lr": lr}, 0, final)
        run.best_test_metric = final
        run.final = FinalMetrics(test_metric=final, train_loss=final, test_loss=final)
        run.write(tmp_path / str(number))
    tuned = tuned_on(load_results(tmp_path))
    assert set(tuned["muon"].grid) == {"adamw_betas", "lr"}
    figure = sensitivity_figure("noisy_quadratic", "adamw_betas", tuned)
    assert len(figure.axes[0].lines) == 0

    paths = write_report(tmp_path)
    assert paths["sensitivity_noisy_quadratic_lr"].read_bytes()[:4] == b"\x89PNG"
    assert "sensitivity_noisy_quadratic_adamw_betas" not in paths
