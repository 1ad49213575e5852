"""PNG plots of diagnostic records and logs (matplotlib, Agg canvas, no pyplot).

Every function writes one PNG file to ``path`` (creating parent folders) and
returns the path. Figures are built with :class:`matplotlib.figure.Figure`, so no
global pyplot state or interactive backend is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from dampednewton.diagnostics.histogram import pairs_outside
from dampednewton.diagnostics.log import DiagnosticsLog, Record


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(path, format="png", dpi=100)
    return path


def _names_with(record: Record, key: str) -> list[str]:
    """Parameter names that have ``key/<name>`` in the record, in record order."""
    prefix = f"{key}/"
    return [k[len(prefix) :] for k in record if k.startswith(prefix)]


def _require(record: Record, key: str) -> None:
    if key not in record:
        raise KeyError(
            f"The record has no {key!r}; was the diagnostic scheduled at step "
            f"{record.get('step')} and is its label right?"
        )


def histograms_figure(record: Record, label: str = "grad_hist") -> Figure:
    """Bar plots (log-scaled counts) of the network and per-parameter histograms.

    The network histogram is binned on a range fixed before the layers are seen
    (see :class:`~dampednewton.diagnostics.GradientHistogram`), which can be
    narrower than a layer's: its panel spans the hull of every panel's range and
    shades the part outside its own bins, where its elements are only counted
    (``below``/``above``), so no layer looks wider than the network.

    Args:
        record: A record with a 1D gradient histogram.
        label: Label of the histogram diagnostic.

    Returns:
        The figure.

    Raises:
        KeyError: If the record has no histogram under ``label``.
    """
    _require(record, f"{label}/counts")
    panels = [("network", "")] + [
        (name, f"/{name}") for name in _names_with(record, f"{label}/counts")
    ]
    all_edges = [
        np.asarray(record[f"{label}/edges{suffix}"], dtype=np.float64)
        for _, suffix in panels
    ]
    hull = (min(e[0] for e in all_edges), max(e[-1] for e in all_edges))
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(4.5 * columns, 3.2 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, (title, suffix), edges in zip(axes, panels, all_edges, strict=False):
        counts = np.asarray(record[f"{label}/counts{suffix}"])
        ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge")
        if counts.any():
            ax.set_yscale("log")
        ax.set_title(
            f"{title}\nbelow {record[f'{label}/below{suffix}']}, "
            f"above {record[f'{label}/above{suffix}']}, "
            f"NaN {record[f'{label}/nan{suffix}']}",
            fontsize=9,
        )
        if not suffix:
            ax.set_xlim(*hull)
            outside = [
                (low, high)
                for low, high in ((hull[0], edges[0]), (edges[-1], hull[1]))
                if high > low
            ]
            for i, (low, high) in enumerate(outside):
                span_label = "outside its range" if i == 0 else "_outside its range"
                ax.axvspan(low, high, color="0.85", zorder=0, label=span_label)
            if outside:
                ax.legend(fontsize=8, loc="upper right")
        ax.set_xlabel("individual gradient element")
        ax.set_ylabel("count")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    figure.suptitle(f"{label}, step {record.get('step')}")
    return figure


def plot_histograms(record: Record, path: str | Path, label: str = "grad_hist") -> Path:
    """Write :func:`histograms_figure` to ``path`` (PNG).

    Args:
        record: A record with a 1D gradient histogram.
        path: Output PNG path.
        label: Label of the histogram diagnostic.

    Returns:
        ``path``.

    Raises:
        KeyError: If the record has no histogram under ``label``.
    """
    return _save(histograms_figure(record, label), path)


def plot_histogram_2d(
    record: Record,
    path: str | Path,
    label: str = "grad_param_hist",
    name: str | None = None,
) -> Path:
    """Heatmap (log color scale) of a gradient-vs-parameter 2D histogram.

    Args:
        record: A record with a 2D histogram.
        path: Output PNG path.
        label: Label of the 2D histogram diagnostic.
        name: Parameter name; ``None`` for the network histogram.

    Returns:
        ``path``.

    Raises:
        KeyError: If the record has no such histogram.
    """
    suffix = "" if name is None else f"/{name}"
    _require(record, f"{label}/counts{suffix}")
    counts = np.asarray(record[f"{label}/counts{suffix}"], dtype=np.float64)
    x_edges = np.asarray(record[f"{label}/x_edges{suffix}"], dtype=np.float64)
    y_edges = np.asarray(record[f"{label}/y_edges{suffix}"], dtype=np.float64)
    outside = pairs_outside(np.asarray(record[f"{label}/margins{suffix}"]))
    figure = Figure(figsize=(6, 4.5), layout="constrained")
    ax = figure.subplots()
    masked = np.ma.masked_equal(counts.T, 0)
    norm = LogNorm(vmin=1, vmax=max(1.0, counts.max()))
    mesh = ax.pcolormesh(x_edges, y_edges, masked, norm=norm, cmap="viridis")
    figure.colorbar(mesh, ax=ax, label="count")
    ax.set_xlabel("individual gradient element")
    ax.set_ylabel("parameter value")
    ax.set_title(
        f"{'network' if name is None else name}, step {record.get('step')}: "
        f"outside {outside}, NaN {record[f'{label}/nan{suffix}']}",
        fontsize=9,
    )
    return _save(figure, path)


def plot_gsnr_and_noise_scale(
    log: DiagnosticsLog,
    path: str | Path,
    gsnr_label: str = "gsnr",
    noise_label: str = "noise_scale",
) -> Path:
    """Mean GSNR (plain, debiased) and noise scale (unbiased, plain) over steps.

    The GSNR axis is linear (the debiased mean can be negative), the noise-scale
    axis logarithmic; non-finite noise scales (no detectable signal) are left out.

    Args:
        log: Log with GSNR and/or noise-scale records.
        path: Output PNG path.
        gsnr_label: Label of the GSNR diagnostic.
        noise_label: Label of the noise-scale diagnostic.

    Returns:
        ``path``.

    Raises:
        KeyError: If the log has neither diagnostic.
    """
    keys = set(log.keys())
    panels = []
    if f"{gsnr_label}/mean" in keys:
        panels.append(
            (
                "mean GSNR",
                {
                    "plain": f"{gsnr_label}/mean",
                    "debiased": f"{gsnr_label}/mean_debiased",
                },
                "linear",
            )
        )
    if f"{noise_label}/b_simple" in keys:
        panels.append(
            (
                "noise scale B_simple",
                {
                    "unbiased parts": f"{noise_label}/b_simple",
                    "plain": f"{noise_label}/b_simple_plain",
                },
                "log",
            )
        )
    if not panels:
        raise KeyError(
            f"The log has neither {gsnr_label!r} nor {noise_label!r} records."
        )
    figure = Figure(figsize=(6, 3 * len(panels)), layout="constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False).ravel()
    for ax, (title, series, scale) in zip(axes, panels, strict=True):
        for legend, key in series.items():
            steps, values = log.series(key)
            keep = np.isfinite(values) & ((values > 0) if scale == "log" else True)
            ax.plot(steps[keep], values[keep], marker=".", label=legend)
        ax.set_yscale(scale)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    return _save(figure, path)


def plot_scalars(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    *,
    title: str = "",
    ylabel: str = "",
    log_y: bool = False,
) -> Path:
    """Line plot of named scalar series over steps (eigenvalues, damping, …).

    Args:
        series: Name → ``(steps, values)`` of equal lengths.
        path: Output PNG path.
        title: Figure title.
        ylabel: Label of the y axis.
        log_y: Logarithmic y axis (non-positive values are left out).

    Returns:
        ``path``.

    Raises:
        ValueError: If ``series`` is empty or a series has unequal lengths.
    """
    if not series:
        raise ValueError("plot_scalars needs at least one series.")
    figure = Figure(figsize=(6, 4), layout="constrained")
    ax = figure.subplots()
    for name, (steps, values) in series.items():
        x = np.asarray(steps, dtype=np.float64)
        y = np.asarray(values, dtype=np.float64)
        if x.shape != y.shape or x.ndim != 1:
            raise ValueError(
                f"Series {name!r} needs 1-D steps and values of equal length, got "
                f"shapes {x.shape} and {y.shape}."
            )
        keep = np.isfinite(y) & ((y > 0) if log_y else True)
        ax.plot(x[keep], y[keep], marker=".", label=name)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return _save(figure, path)
