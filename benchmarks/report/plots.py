"""PNG plots of a sweep: learning curves, hyperparameter sensitivity, per-step cost.

Figures are built with :class:`matplotlib.figure.Figure` on the Agg canvas (no pyplot
state); each ``*_figure`` function returns the figure, each ``plot_*`` writes it.
Spread over seeds is drawn as a band: mean ± std on a linear axis, and on a log axis
(a loss metric) the geometric mean ×/÷ the geometric std, which stays positive.
"""

from __future__ import annotations

import math
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks.report.aggregate import Setting, Tuned, describing_run
from benchmarks.sweep.result import RunResult, recorded

#: A sensitivity curve whose means differ by less than this fraction is flat.
FLAT_TOLERANCE = 1e-4

#: Characters per line of a sensitivity plot's title (it must fit the figure).
TITLE_WIDTH = 50

#: Grids whose largest value over the smallest is at least this go on a log axis.
LOG_AXIS_RANGE = 10.0


def metric_label(metric: str) -> str:
    """Axis label of a test metric."""
    return f"test {metric}"


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=110)
    return path


def _stack(runs: Sequence[RunResult], key: str) -> np.ndarray:
    """Curves of several seeds as a NaN-padded ``[seeds, evaluations]`` array."""
    curves = [np.asarray(getattr(r.curves, key), dtype=float) for r in runs]
    length = max(len(c) for c in curves)
    out = np.full((len(curves), length), np.nan)
    for i, curve in enumerate(curves):
        out[i, : len(curve)] = curve
    return out


def seed_band(
    values: np.ndarray, log: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Center and band over seeds (axis 0) of values, NaNs (diverged seeds) left out.

    On a linear axis: mean and mean ± sample std. On a log axis: the geometric mean
    ``g = exp(mean(log v))`` and ``g ·/÷ exp(std(log v))`` over the positive values,
    so the band never reaches 0 (where a log axis has no room). The std is 0 for a
    single value; a column without values gives NaN.

    Args:
        values: ``[seeds, points]``.
        log: Whether the axis is logarithmic.

    Returns:
        ``(center, low, high)``, each ``[points]``.
    """
    values = np.asarray(values, dtype=np.float64)
    if log:
        values = np.log(np.where(values > 0, values, np.nan))
    count = np.isfinite(values).sum(axis=0)
    with warnings.catch_warnings():  # all-NaN columns after a divergence
        warnings.simplefilter("ignore", RuntimeWarning)
        center = np.nanmean(values, axis=0)
        std = np.where(count > 1, np.nanstd(values, axis=0, ddof=1), 0.0)
    std = np.where(count > 0, std, np.nan)
    if log:
        return np.exp(center), np.exp(center - std), np.exp(center + std)
    return center, center - std, center + std


def _spread_label(log: bool) -> str:
    return "geometric mean ×/÷ geometric std" if log else "mean ± std"


def _setting_label(optimizer: str, tuned: Tuned) -> str:
    """Legend entry: the optimizer and its tuned varied hyperparameters."""
    values = ", ".join(
        f"{k}={tuned.best.hyperparameters[k]:g}"
        if isinstance(tuned.best.hyperparameters[k], float)
        else f"{k}={tuned.best.hyperparameters[k]}"
        for k in tuned.grid
    )
    return f"{optimizer} ({values})" if values else optimizer


def curves_figure(problem: str, tuned: dict[str, Tuned]) -> Figure:
    """Test metric vs steps and vs training seconds, spread over seeds.

    Args:
        problem: Problem name (title).
        tuned: Optimizer name → its tuned setting on this problem.

    Returns:
        The figure.
    """
    figure = Figure(figsize=(11, 4), layout="constrained")
    axes = figure.subplots(1, 2, sharey=True)
    trained = {
        optimizer: [r for r in choice.best.runs if r.trained]
        for optimizer, choice in tuned.items()
    }
    trained = {optimizer: runs for optimizer, runs in trained.items() if runs}
    first = next(iter(trained.values()), [None])[0]
    metric = (first.metric if first is not None else None) or "metric"
    maximize = first.maximize if first is not None else True
    log = not maximize  # a loss metric spans decades
    for optimizer, runs in trained.items():
        center, low, high = seed_band(_stack(runs, "test_metric"), log)
        steps = np.nanmean(_stack(runs, "step"), axis=0)
        seconds = np.nanmean(_stack(runs, "time"), axis=0)
        (line,) = axes[0].plot(
            steps, center, label=_setting_label(optimizer, tuned[optimizer])
        )
        color = line.get_color()
        axes[0].fill_between(steps, low, high, color=color, alpha=0.2)
        timed = seconds > 0  # log axis: the evaluation at t = 0 is left out
        axes[1].plot(seconds[timed], center[timed], color=color)
        axes[1].fill_between(
            seconds[timed], low[timed], high[timed], color=color, alpha=0.2
        )
    axes[0].set_xlabel("step")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("training time [s] (evaluation excluded)")
    axes[0].set_ylabel(metric_label(metric))
    if log:
        axes[0].set_yscale("log")
    if trained:
        axes[0].legend(fontsize="small")
    else:
        axes[0].text(
            0.5, 0.5, "no run trained", ha="center", transform=axes[0].transAxes
        )
    figure.suptitle(f"{problem}: tuned settings, {_spread_label(log)} over seeds")
    return figure


def plot_curves(problem: str, tuned: dict[str, Tuned], path: Path) -> Path:
    """Write :func:`curves_figure` to ``path`` (PNG) and return ``path``."""
    return _save(curves_figure(problem, tuned), path)


def _value_axis(values: Sequence[float]) -> str:
    """``"log"`` for a positive grid spanning a decade or more, else ``"linear"``.

    Learning rates and dampings (half-decade grids) get a log axis; small integers
    such as ``z ∈ {1, 2, 3, 4}`` a linear one.
    """
    positive = all(v > 0 for v in values)
    spans_decades = positive and max(values) >= LOG_AXIS_RANGE * min(values)
    return "log" if spans_decades else "linear"


def numeric_grid(choice: Tuned, key: str) -> bool:
    """Whether ``choice`` varied ``key`` over numbers (a sensitivity plot's axis)."""
    values = choice.grid.get(key, [])
    return bool(values) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    )


def _lm_start_value(key: str, choice: Tuned) -> bool:
    """Whether ``key`` is Levenberg-Marquardt's start value of the damping."""
    policy = choice.best.hyperparameters.get("damping._target_", "")
    return key == "damping.value" and str(policy).endswith("LevenbergMarquardt")


def _final_metrics(
    key: str, choice: Tuned
) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """The values of ``key`` tried with the other settings at their tuned values.

    Args:
        key: The varied hyperparameter.
        choice: The tuned setting of one optimizer.

    Returns:
        The values (ascending), the final test metrics ``[seeds, values]`` of the
        successful seeds (NaN-padded), and the values with a diverged or failed seed.
    """
    others = {k: v for k, v in choice.best.hyperparameters.items() if k != key}
    points = sorted(
        (
            (float(s.hyperparameters[key]), s)
            for s in choice.candidates
            if isinstance(s.hyperparameters.get(key), int | float)
            and {k: v for k, v in s.hyperparameters.items() if k != key} == others
        ),
        key=lambda point: point[0],
    )
    seeds = max((len(s.runs) for _, s in points), default=0)
    finals = np.full((seeds, len(points)), np.nan)
    for column, (_, setting) in enumerate(points):
        metrics = [recorded(r.final, "final").test_metric for r in setting.ok_runs]
        finals[: len(metrics), column] = metrics
    values = np.array([value for value, _ in points])
    return values, finals, [value for value, s in points if not s.complete]


def sensitivity_figure(problem: str, key: str, tuned: dict[str, Tuned]) -> Figure:
    """Final test metric against one hyperparameter, others at their tuned values.

    Settings with a diverged or failed seed are drawn as crosses at the bottom. The
    x axis is logarithmic for grids spanning a decade or more, with a tick at every
    value tried. A plot whose every curve is flat (means within
    :data:`FLAT_TOLERANCE`) says so on the axes.

    Args:
        problem: Problem name (title).
        key: The hyperparameter on the x-axis (e.g. ``"lr"``).
        tuned: Optimizer name → its tuned setting on this problem (only optimizers
            that varied ``key`` over numbers are drawn).

    Returns:
        The figure.
    """
    figure = Figure(figsize=(6, 4), layout="constrained")
    ax = figure.subplots()
    varied = {o: choice for o, choice in tuned.items() if numeric_grid(choice, key)}
    first = next(iter(varied.values()), None)
    described = (
        describing_run(r for t in varied.values() for r in t.best.runs)
        if first
        else None
    )
    metric = (described.metric or "metric") if described else "metric"
    log = described is not None and described.maximize is False  # a loss spans decades
    drawn = []
    for optimizer, choice in varied.items():
        x, finals, crosses = _final_metrics(key, choice)
        center, low, high = seed_band(finals, log)
        (handle,) = ax.plot(
            x, center, marker="o", label=_setting_label(optimizer, choice)
        )
        ax.fill_between(x, low, high, color=handle.get_color(), alpha=0.2)
        ax.plot(
            crosses,
            [0.0] * len(crosses),
            "x",
            color=handle.get_color(),
            ms=9,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
        )
        drawn.append((optimizer, x, center))
    values = sorted({v for _, x, _ in drawn for v in x})
    if values:
        ax.set_xscale(_value_axis(values))
        ax.set_xticks(values, [f"{v:g}" for v in values])
        ax.minorticks_off()
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(f"final {metric_label(metric)}")
    ax.set_title(
        textwrap.fill(f"{problem}: sensitivity to {key}", TITLE_WIDTH)
        + "\n"
        + textwrap.fill(
            f"{_spread_label(log)} over seeds; × = a seed diverged or failed",
            TITLE_WIDTH,
        ),
        fontsize="medium",
    )
    ax.legend(fontsize="small")
    flat = [
        optimizer
        for optimizer, _, center in drawn
        if np.isfinite(center).any()
        and np.nanmax(center) - np.nanmin(center)
        <= FLAT_TOLERANCE * np.nanmax(np.abs(center))
    ]
    if drawn and len(flat) == len(drawn):
        note = (
            f"Flat: the final {metric_label(metric)} does not depend on {key} here "
            f"(every value within {FLAT_TOLERANCE:.0e} relative)."
        )
        if all(_lm_start_value(key, tuned[optimizer]) for optimizer in flat):
            note += (
                " Levenberg-Marquardt only starts from this δ and adapts it every "
                "step: where its model is exact (ρ ≈ 1, as on a quadratic), every "
                "start shrinks to the same floor."
            )
        ax.text(
            0.5,
            0.5,
            textwrap.fill(note, 50),
            ha="center",
            va="center",
            fontsize="small",
            transform=ax.transAxes,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "0.6"},
        )
    return figure


def plot_sensitivity(
    problem: str, key: str, tuned: dict[str, Tuned], path: Path
) -> Path:
    """Write :func:`sensitivity_figure` to ``path`` (PNG) and return ``path``."""
    return _save(sensitivity_figure(problem, key, tuned), path)


def step_cost_figure(settings: Sequence[Setting]) -> Figure:
    """Median per-step time per optimizer and problem (bars: median, whiskers: range).

    Args:
        settings: All settings of the sweep.

    Returns:
        The figure (with a note instead of bars when no run was timed).
    """
    problems = list(dict.fromkeys(s.problem for s in settings))
    optimizers = list(dict.fromkeys(s.optimizer for s in settings))
    width = 0.8 / max(len(optimizers), 1)
    figure = Figure(
        figsize=(max(5, 1.8 * len(problems) * len(optimizers) ** 0.5), 4),
        layout="constrained",
    )
    ax = figure.subplots()
    timed = False
    for j, optimizer in enumerate(optimizers):
        medians, lows, highs = [], [], []
        for problem in problems:
            times = [
                1e3 * t
                for s in settings
                if s.problem == problem and s.optimizer == optimizer
                for t in s.step_times()
            ]
            if times:
                timed = True
                median = float(np.median(times))
                medians.append(median)
                lows.append(median - min(times))
                highs.append(max(times) - median)
            else:
                medians.append(math.nan)
                lows.append(0.0)
                highs.append(0.0)
        x = np.arange(len(problems)) + (j - (len(optimizers) - 1) / 2) * width
        ax.bar(x, medians, width, yerr=[lows, highs], capsize=3, label=optimizer)
    ax.set_xticks(np.arange(len(problems)), problems)
    if timed:
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no run was timed", ha="center", transform=ax.transAxes)
    ax.set_ylabel("median time per step [ms]")
    ax.set_title("Median time per step after warm-up\n(whiskers: range over runs)")
    return figure


def plot_step_cost(settings: Sequence[Setting], path: Path) -> Path:
    """Write :func:`step_cost_figure` to ``path`` (PNG) and return ``path``."""
    return _save(step_cost_figure(settings), path)
