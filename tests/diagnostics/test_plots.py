"""Plot functions write non-empty PNG files."""

from __future__ import annotations

import numpy as np
import pytest

from dampednewton.diagnostics import (
    GSNR,
    DiagnosticsMonitor,
    GradientHistogram,
    GradientParameterHistogram,
    NoiseScale,
)
from dampednewton.diagnostics.plots import (
    histograms_figure,
    plot_gsnr_and_noise_scale,
    plot_histogram_2d,
    plot_histograms,
    plot_scalars,
)
from tests.cases import DIAGNOSTICS_PROBLEMS
from tests.utils import build_case, run_monitored_step

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def monitor() -> DiagnosticsMonitor:
    case = build_case(DIAGNOSTICS_PROBLEMS[2])
    monitor = DiagnosticsMonitor(
        [
            GSNR(),
            NoiseScale(),
            GradientHistogram(bins=16),
            GradientParameterHistogram(bins=(12, 10)),
        ],
        case.model.named_parameters(),
    )
    for step in range(3):
        run_monitored_step(case, monitor, step)
    return monitor


def assert_png(path, expected):
    assert path == expected
    content = path.read_bytes()
    assert content.startswith(PNG_SIGNATURE)
    assert len(content) > 5_000, f"{path} is suspiciously small ({len(content)} B)"


def test_histogram_plots(tmp_path, monitor):
    record = monitor.log[-1]
    assert_png(plot_histograms(record, tmp_path / "hist.png"), tmp_path / "hist.png")
    for name in (None, "0.weight"):
        path = tmp_path / "sub" / f"hist2d-{name}.png"
        assert_png(plot_histogram_2d(record, path, name=name), path)


def test_gsnr_and_noise_scale_plot(tmp_path, monitor):
    path = tmp_path / "gsnr.png"
    assert_png(plot_gsnr_and_noise_scale(monitor.log, path), path)


def test_scalars_plot(tmp_path):
    steps = np.arange(10)
    series = {
        "λ_1": (steps, 1.0 + steps**2),
        "λ_2": (steps, np.where(steps == 3, np.inf, 0.5 + steps)),
        "damping": (list(steps), [0.0, *np.logspace(-3, 0, 9)]),
    }
    path = tmp_path / "scalars.png"
    assert_png(
        plot_scalars(series, path, title="eigenvalues", ylabel="λ", log_y=True), path
    )


def test_missing_data_raise(tmp_path, monitor):
    with pytest.raises(KeyError, match="no 'nope/counts'"):
        plot_histograms(monitor.log[-1], tmp_path / "x.png", label="nope")
    with pytest.raises(KeyError, match="neither"):
        plot_gsnr_and_noise_scale(
            monitor.log, tmp_path / "x.png", gsnr_label="a", noise_label="b"
        )
    with pytest.raises(ValueError, match="at least one series"):
        plot_scalars({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="equal length"):
        plot_scalars({"a": ([1, 2], [1.0])}, tmp_path / "x.png")


def test_network_histogram_panel_spans_every_layer_range():
    """The network's bins (a lagged range) are narrower than a layer's.

    Its panel spans the hull of all ranges and shades the part outside its bins.
    """
    record = {"step": 3}
    for suffix, (low, high) in {"": (-1.0, 1.0), "/w": (-3.0, 2.0)}.items():
        record[f"grad_hist/counts{suffix}"] = np.array([1, 4, 2, 0])
        record[f"grad_hist/edges{suffix}"] = np.linspace(low, high, 5)
        for key in ("below", "above", "nan"):
            record[f"grad_hist/{key}{suffix}"] = 0
    network = histograms_figure(record).axes[0]
    assert network.get_xlim() == (-3.0, 2.0)  # the layer's range, wider than its own
    shaded = [
        (p.get_x(), p.get_x() + p.get_width())
        for p in network.patches
        if p.get_label().endswith("outside its range")
    ]
    assert shaded == [(-3.0, -1.0), (1.0, 2.0)]
