"""PNG plots of a sweep: learning curves, hyperparameter sensitivity, per-step cost."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from benchmarks.aggregate import Setting, Tuned


def metric_label(metric: str) -> str:
    """Axis label of a test metric."""
    return f"test {metric}"


def _stack(runs: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    """Curves of several seeds as a NaN-padded ``[seeds, evaluations]`` array."""
    curves = [np.asarray(r["curves"][key], dtype=float) for r in runs]
    length = max(len(c) for c in curves)
    out = np.full((len(curves), length), np.nan)
    for i, curve in enumerate(curves):
        out[i, : len(curve)] = curve
    return out


def _setting_label(optimizer: str, tuned: Tuned) -> str:
    """Legend entry: the optimizer and its tuned varied hyperparameters."""
    values = ", ".join(
        f"{k}={tuned.best.hyperparameters[k]:g}"
        if isinstance(tuned.best.hyperparameters[k], float)
        else f"{k}={tuned.best.hyperparameters[k]}"
        for k in tuned.grid
    )
    return f"{optimizer} ({values})" if values else optimizer


def plot_curves(problem: str, tuned: dict[str, Tuned], path: Path) -> Path:
    """Test metric vs steps and vs training seconds, mean ± std over seeds.

    Args:
        problem: Problem name (title).
        tuned: Optimizer name → its tuned setting on this problem.
        path: Output PNG.

    Returns:
        ``path``.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    metric, maximize = "metric", True
    for optimizer, choice in tuned.items():
        runs = [r for r in choice.best.runs if "curves" in r]
        if not runs:
            continue
        metric, maximize = runs[0]["metric"], runs[0]["maximize"]
        values = _stack(runs, "test_metric")
        steps = np.nanmean(_stack(runs, "step"), axis=0)
        seconds = np.nanmean(_stack(runs, "time"), axis=0)
        with warnings.catch_warnings():  # all-NaN columns after a divergence
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(values, axis=0)
            std = np.nanstd(values, axis=0)
        label = _setting_label(optimizer, choice)
        (line,) = axes[0].plot(steps, mean, label=label)
        color = line.get_color()
        axes[0].fill_between(steps, mean - std, mean + std, color=color, alpha=0.2)
        timed = seconds > 0  # log axis: the evaluation at t = 0 is left out
        axes[1].plot(seconds[timed], mean[timed], color=color)
        axes[1].fill_between(
            seconds[timed],
            (mean - std)[timed],
            (mean + std)[timed],
            color=color,
            alpha=0.2,
        )
    axes[0].set_xlabel("step")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("training time [s] (evaluation excluded)")
    axes[0].set_ylabel(metric_label(metric))
    if not maximize:
        axes[0].set_yscale("log")
    axes[0].legend(fontsize="small")
    fig.suptitle(f"{problem}: tuned settings, mean ± std over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sensitivity(
    problem: str, key: str, tuned: dict[str, Tuned], path: Path
) -> Path:
    """Final test metric against one hyperparameter, others at their tuned values.

    Settings with a diverged or failed seed are drawn as crosses at the bottom.

    Args:
        problem: Problem name (title).
        key: The hyperparameter on the x-axis (e.g. ``"lr"``).
        tuned: Optimizer name → its tuned setting on this problem (only optimizers
            that varied ``key`` are drawn).
        path: Output PNG.

    Returns:
        ``path``.
    """
    fig, ax = plt.subplots(figsize=(6, 4))
    metric, maximize = "metric", True
    for optimizer, choice in tuned.items():
        if key not in choice.grid:
            continue
        others = {k: v for k, v in choice.best.hyperparameters.items() if k != key}
        line: list[tuple[float, float, float, bool]] = []
        for setting in choice.candidates:
            rest = {k: v for k, v in setting.hyperparameters.items() if k != key}
            value = setting.hyperparameters.get(key)
            if rest != others or not isinstance(value, int | float):
                continue
            mean, std = setting.final("test_metric")
            line.append((float(value), mean, std, setting.complete))
            metric, maximize = setting.runs[0].get("metric", metric), setting.maximize
        line.sort()
        x = np.array([p[0] for p in line])
        mean = np.array([p[1] for p in line])
        std = np.array([p[2] for p in line])
        (handle,) = ax.plot(
            x, mean, marker="o", label=_setting_label(optimizer, choice)
        )
        ax.fill_between(x, mean - std, mean + std, color=handle.get_color(), alpha=0.2)
        bad = [p[0] for p in line if not p[3]]
        ax.plot(
            bad,
            [0.0] * len(bad),
            "x",
            color=handle.get_color(),
            ms=9,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
        )
    if all(x > 0 for line in ax.get_lines() for x in line.get_xdata()):
        ax.set_xscale("log")
    if not maximize:
        ax.set_yscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(f"final {metric_label(metric)}")
    ax.set_title(f"{problem}: sensitivity to {key} (× = diverged/failed seed)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_step_cost(settings: Sequence[Setting], path: Path) -> Path:
    """Median per-step time per optimizer and problem (bars: median, whiskers: range).

    Args:
        settings: All settings of the sweep.
        path: Output PNG.

    Returns:
        ``path``.
    """
    problems = list(dict.fromkeys(s.problem for s in settings))
    optimizers = list(dict.fromkeys(s.optimizer for s in settings))
    width = 0.8 / max(len(optimizers), 1)
    fig, ax = plt.subplots(
        figsize=(max(5, 1.8 * len(problems) * len(optimizers) ** 0.5), 4)
    )
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
    ax.set_yscale("log")
    ax.set_ylabel("median time per step [ms]")
    ax.set_title("Median time per step after warm-up\n(whiskers: range over runs)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
