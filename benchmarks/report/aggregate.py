"""Aggregate the ``result.json`` files of a sweep: settings, seeds, tuning.

A *setting* is one (problem, optimizer, hyperparameters) triple; its runs differ only
in the seed (:mod:`benchmarks.report.loading` names a problem's runs apart where
their problem or machine settings differ). The *tuned* setting of a (problem,
optimizer) pair is the one with the best mean final test metric over seeds; settings
in which any seed diverged or failed rank below all others. A tuned value is *on the
grid edge* when it is the smallest or largest value tried for a hyperparameter that
was varied.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.sweep.result import RunResult, recorded


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value, NaN for none)."""
    if not values:
        return math.nan, math.nan
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), std


def _key(hyperparameters: dict[str, Any]) -> str:
    """Hashable, order-independent key of a hyperparameter dict."""
    return json.dumps(hyperparameters, sort_keys=True)


@dataclass
class Setting:
    """The runs of one (problem, optimizer, hyperparameters) over seeds.

    Attributes:
        problem: Problem name.
        optimizer: Optimizer name.
        hyperparameters: The optimizer's settings.
        runs: The results (one per seed).
    """

    problem: str
    optimizer: str
    hyperparameters: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)

    @property
    def ok_runs(self) -> list[RunResult]:
        """Runs that neither diverged nor failed."""
        return [r for r in self.runs if r.status == "ok"]

    @property
    def complete(self) -> bool:
        """Whether every seed finished without divergence or failure."""
        return len(self.ok_runs) == len(self.runs)

    @property
    def maximize(self) -> bool:
        """Whether the test metric is to be maximized (from any trained run)."""
        return next((r.maximize for r in self.runs if r.maximize is not None), True)

    def final(self, key: str) -> tuple[float, float]:
        """Mean ± std over the successful seeds of ``final.<key>``."""
        return mean_std([getattr(r.final, key) for r in self.ok_runs])

    def best_metric(self) -> tuple[float, float]:
        """Mean ± std over the successful seeds of the best test metric."""
        return mean_std(
            [recorded(r.best_test_metric, "best_test_metric") for r in self.ok_runs]
        )

    def to_target(self, key: str, index: int) -> tuple[float, float, int]:
        """Mean ± std of ``steps_to_target``/``time_to_target`` and how many reached.

        Args:
            key: ``"steps_to_target"`` or ``"time_to_target"``.
            index: Which target of the problem (0: the easier).

        Returns:
            Mean and std over the successful seeds that reached the target, and
            their number.
        """
        reached = [getattr(r, key)[index] for r in self.ok_runs]
        values = [value for value in reached if value is not None]
        return (*mean_std(values), len(values))

    def divergences(self) -> list[tuple[int, str]]:
        """``(seed, reason)`` of every diverged run."""
        return [(r.seed, r.divergence) for r in self.runs if r.divergence]

    @property
    def extended_from(self) -> dict[str, Any] | None:
        """How the grid extension added this setting (``None``: in the sweep's grid).

        See :mod:`benchmarks.sweep.grid_extension`.
        """
        return next((r.extended_from for r in self.runs if r.extended_from), None)

    def step_times(self) -> list[float]:
        """Median per-step times of the runs that trained (any status)."""
        return [
            r.step_time.median
            for r in self.runs
            if r.step_time is not None and r.step_time.median is not None
        ]

    def peak_memory(self) -> tuple[float, str | None]:
        """Largest peak memory (MiB) over the runs, and its kind."""
        readings = [r.memory for r in self.runs if r.memory is not None]
        if not readings:
            return math.nan, None
        return max(m.peak_mb for m in readings), readings[0].kind

    def score(self) -> float:
        """Tuning score (higher wins): ±mean final test metric; −inf if incomplete."""
        mean, _ = self.final("test_metric")
        if not self.complete or not math.isfinite(mean):
            return -math.inf
        return mean if self.maximize else -mean


def group_settings(results: Iterable[RunResult]) -> list[Setting]:
    """Group results by (problem, optimizer, hyperparameters).

    Runs that failed before their hyperparameters were known (e.g. an invalid grid)
    share the setting with empty hyperparameters.

    Args:
        results: Loaded results.

    Returns:
        The settings, in order of first appearance.
    """
    settings: dict[tuple[str, str, str], Setting] = {}
    for result in results:
        hyper = result.hyperparameters or {}
        key = (result.problem, result.optimizer, _key(hyper))
        if key not in settings:
            settings[key] = Setting(result.problem, result.optimizer, hyper)
        settings[key].runs.append(result)
    return list(settings.values())


def _sortable(value: Any) -> Any:
    """Order numbers numerically, everything else by its text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, json.dumps(value))


@dataclass
class Tuned:
    """The tuned setting of one (problem, optimizer) pair.

    Attributes:
        best: The best setting.
        candidates: All settings of the pair.
        grid: Values tried for every varied hyperparameter (sorted).
        edges: Varied hyperparameters whose tuned value is the smallest or largest
            tried, mapped to ``"min"`` or ``"max"``.
    """

    best: Setting
    candidates: list[Setting]
    grid: dict[str, list[Any]]
    edges: dict[str, str]


def describing_run(runs: Iterable[RunResult]) -> RunResult:
    """The run whose record names the problem's metric, direction and targets.

    The first run that trained (a failed job records none of them), else the first.

    Args:
        runs: Runs of one problem (at least one).

    Returns:
        That run.
    """
    runs = list(runs)
    return next((r for r in runs if r.maximize is not None), runs[0])


def tune(settings: Iterable[Setting]) -> dict[tuple[str, str], Tuned]:
    """Pick the best setting of every (problem, optimizer) pair.

    Args:
        settings: Grouped settings.

    Returns:
        ``(problem, optimizer) → Tuned``.
    """
    pairs: dict[tuple[str, str], list[Setting]] = defaultdict(list)
    for setting in settings:
        pairs[(setting.problem, setting.optimizer)].append(setting)
    tuned = {}
    for pair, candidates in pairs.items():
        best = max(candidates, key=Setting.score)
        keys = sorted({k for s in candidates for k in s.hyperparameters})
        grid, edges = {}, {}
        for key in keys:
            values = {
                _key(s.hyperparameters[key]): s.hyperparameters[key]
                for s in candidates
                if key in s.hyperparameters
            }
            if len(values) < 2:
                continue
            ordered = sorted(values.values(), key=_sortable)
            grid[key] = ordered
            chosen = best.hyperparameters.get(key)
            if all(_sortable(v)[0] == 0 for v in ordered):
                if chosen == ordered[0]:
                    edges[key] = "min"
                elif chosen == ordered[-1]:
                    edges[key] = "max"
        tuned[pair] = Tuned(best, candidates, grid, edges)
    return tuned


def step_time_ratio(
    settings: Iterable[Setting], problem: str, optimizer: str, reference: str = "sgd"
) -> float:
    """Median per-step time of ``optimizer`` over ``reference`` on ``problem``.

    Uses the medians of all runs of each optimizer on the problem (per-step cost
    hardly depends on hyperparameters, so all runs add samples).

    Args:
        settings: Grouped settings.
        problem: Problem name.
        optimizer: Optimizer name.
        reference: Optimizer in the denominator.

    Returns:
        The ratio, NaN if either optimizer has no timed run on the problem.
    """
    times: dict[str, list[float]] = defaultdict(list)
    for setting in settings:
        if setting.problem == problem:
            times[setting.optimizer].extend(setting.step_times())
    if not times[optimizer] or not times[reference]:
        return math.nan
    return statistics.median(times[optimizer]) / statistics.median(times[reference])


@dataclass(frozen=True)
class FastestToTarget:
    """AlgoPerf's figure of one optimizer to one target: the grid's fastest run.

    Every seed is a tuning study: its fastest run over the grid points that reached
    the target (``inf`` if none did); the figure is the median over seeds (the upper
    one for an even count, so that it is a run's own value).

    Attributes:
        value: Steps or training seconds to the target (``inf``: the median seed
            never reached it).
        setting: The grid point of the median seed's fastest run (``None`` if it
            never reached the target).
        seeds_reached: Seeds with a run that reached the target.
        seeds: Seeds in all.
    """

    value: float
    setting: Setting | None
    seeds_reached: int
    seeds: int

    @property
    def reached(self) -> bool:
        """Whether the median seed reached the target."""
        return math.isfinite(self.value)


def fastest_to_target(
    candidates: Iterable[Setting], key: str, index: int
) -> FastestToTarget:
    """The grid's fastest run to a target, AlgoPerf's rule over seeds.

    Args:
        candidates: The settings (grid points) of one (problem, optimizer).
        key: ``"steps_to_target"`` or ``"time_to_target"``.
        index: Which target of the problem (0: the easier).

    Returns:
        The median over seeds of each seed's fastest successful run to the target.
    """
    per_seed: dict[int, tuple[float, Setting | None]] = {}
    for setting in candidates:
        for run in setting.runs:
            best = per_seed.setdefault(run.seed, (math.inf, None))
            value = getattr(run, key)[index] if run.status == "ok" else None
            if value is not None and value < best[0]:
                per_seed[run.seed] = (float(value), setting)
    ordered = sorted(per_seed.values(), key=lambda pair: pair[0])
    if not ordered:
        return FastestToTarget(math.inf, None, 0, 0)
    value, fastest = ordered[len(ordered) // 2]
    reached = sum(math.isfinite(v) for v, _ in ordered)
    return FastestToTarget(value, fastest, reached, len(ordered))
