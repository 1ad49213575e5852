"""Grid extension at the edge: run more settings where a tuned value is on an edge.

At the end of a multirun, :func:`extend_sweep` tunes the sweep
(:func:`benchmarks.report.aggregate.tune`). For every (problem, optimizer) pair whose
tuned setting has every seed ``ok`` and whose tuned value of a varied hyperparameter is
the smallest (largest) value tried, it adds one point half a decade beyond that edge:
the edge value divided (multiplied) by ``10**0.5``. Only grids of positive numbers that
are not all integers are extended (a learning rate or a damping, not ``criterion``). The
new setting is the tuned one with that value changed, run on every seed of the tuned
setting: each job is the stored config of one tuned run with the new value (``grid`` and
``grid_point`` cleared, ``extended_from`` set), run in-process by
:func:`benchmarks.sweep.job.run_job` into the next numbered subdirectory of the sweep
directory. Then the sweep is tuned again, for at most ``rounds`` rounds. Under
``torchrun`` every rank runs the jobs of rank 0's plan (:func:`plan_round`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from benchmarks.report.aggregate import Tuned, group_settings, tune
from benchmarks.report.loading import distinguish_protocols, job_order
from benchmarks.sweep.callbacks import summary_line
from benchmarks.sweep.config_dict import config_dict
from benchmarks.sweep.data_parallel import launched_rank
from benchmarks.sweep.job import run_job
from benchmarks.sweep.result import RESULT_FILE, RunResult
from benchmarks.sweep.resume import sweep_results

#: Ratio between neighbouring grid values: half a decade.
FACTOR = 10**0.5


@dataclass(frozen=True)
class Extension:
    """One setting to add beyond the edge of a grid.

    Attributes:
        problem: Problem name.
        optimizer: Optimizer name.
        key: The hyperparameter whose tuned value is on the edge.
        edge: ``"min"`` or ``"max"``.
        value: The tuned (edge) value.
        new_value: The value half a decade beyond it.
        runs: The tuned setting's results (one per seed), whose configs are copied.
    """

    problem: str
    optimizer: str
    key: str
    edge: str
    value: float
    new_value: float
    runs: list[RunResult]


def _extendable(values: list[Any]) -> bool:
    """Whether a grid is positive and not integer-valued (log-spaced by design)."""
    numbers = all(
        isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values
    )
    return numbers and not all(isinstance(v, int) for v in values)


def extensions(tuned: dict[tuple[str, str], Tuned]) -> list[Extension]:
    """The settings to add for tuned values on a grid edge.

    Args:
        tuned: ``(problem, optimizer) → Tuned``, from
            :func:`~benchmarks.report.aggregate.tune`.

    Returns:
        One extension per (pair, hyperparameter) on an extendable edge; none for a
        pair whose tuned setting has a diverged or failed seed.
    """
    found = []
    for (problem, optimizer), choice in tuned.items():
        if not math.isfinite(choice.best.score()):
            continue
        for key, edge in choice.edges.items():
            if not _extendable(choice.grid[key]):
                continue
            value = choice.best.hyperparameters[key]
            new_value = value * FACTOR if edge == "max" else value / FACTOR
            found.append(
                Extension(
                    problem, optimizer, key, edge, value, new_value, choice.best.runs
                )
            )
    return found


def job_config(extension: Extension, run: RunResult, round_: int) -> DictConfig:
    """The config of one extension job: a tuned run's config with the new value.

    Args:
        extension: The setting to add.
        run: One result of the tuned setting (its stored ``config`` is copied).
        round_: The extension round (1-based).

    Returns:
        The job config.
    """
    cfg = OmegaConf.create(run.config)
    cfg.grid, cfg.grid_point = None, None
    OmegaConf.update(cfg.optimizer, extension.key, extension.new_value, merge=False)
    cfg.extended_from = {
        "key": extension.key,
        "edge": extension.edge,
        "value": extension.value,
        "round": round_,
    }
    return cfg


def _before_round(result: RunResult, round_: int) -> bool:
    """Whether a result is the sweep's own or from an extension round before this."""
    origin = result.extended_from
    return origin is None or origin["round"] < round_


@dataclass(frozen=True)
class ExtensionJob:
    """One job of an extension round, as plain (picklable) data.

    Attributes:
        announcement: The line announcing its extension (on its first job only).
        config: The job config (:func:`job_config`) as a container.
        number: Its numbered subdirectory of the sweep.
    """

    announcement: str | None
    config: dict[str, Any]
    number: int


def plan_round(sweep_dir: Path, round_: int, rounds: int) -> list[ExtensionJob]:
    """The jobs of one extension round, from the sweep's results so far.

    Args:
        sweep_dir: The sweep directory.
        round_: This round (1-based).
        rounds: The number of rounds at most (for the announcement).

    Returns:
        The jobs, numbered after the sweep's last job; empty when no tuned value
        is on an extendable edge. The round sees only the sweep's own results and
        those of earlier rounds, so that a rerun of an interrupted sweep plans the
        same jobs into the same directories (where :func:`~benchmarks.sweep.job.run_job`
        keeps those that completed).
    """
    earlier = {
        number: result
        for number, result in sweep_results(sweep_dir).items()
        if _before_round(result, round_)
    }
    # As the report sees them: in loading.load_results' order (ties between
    # settings go the same way), each problem setting tuned apart.
    trained = distinguish_protocols(
        sorted(
            (result for result in earlier.values() if result.status != "skipped"),
            key=lambda result: job_order(Path(str(result.job_dir)) / RESULT_FILE),
        )
    )
    jobs = []
    number = max(earlier, default=-1) + 1
    for extension in extensions(tune(group_settings(trained))):
        announcement: str | None = (
            f"grid extension {round_}/{rounds}: {extension.problem} "
            f"{extension.optimizer} {extension.key}={extension.value:g} is the "
            f"{extension.edge} of its grid; adding {extension.new_value:g}"
        )
        for run in extension.runs:
            config = config_dict(job_config(extension, run, round_), resolve=False)
            jobs.append(ExtensionJob(announcement, config, number))
            announcement, number = None, number + 1
    return jobs


def extend_sweep(
    sweep_dir: Path,
    rounds: int,
    log: Callable[[str], None] = print,
    share: Callable[[list[ExtensionJob] | None], list[ExtensionJob] | None]
    | None = None,
) -> int:
    """Extend the sweep's grids at their edges, at most ``rounds`` times.

    Args:
        sweep_dir: The sweep directory (numbered job subdirectories).
        rounds: Maximum number of rounds (0: none).
        log: Receives one line per extension and per finished job.
        share: Under ``torchrun``: gives every rank rank 0's plan of a round (the
            other ranks pass ``None``, and neither read results nor log), so that
            all ranks run the same jobs together. ``None``: one process.

    Returns:
        The number of jobs run.
    """
    sweep_dir = Path(sweep_dir)
    main = share is None or launched_rank() == 0
    jobs = 0
    for round_ in range(1, rounds + 1):
        plan = plan_round(sweep_dir, round_, rounds) if main else None
        todo = plan if share is None else share(plan)
        if not todo:
            break
        for job in todo:
            if main and job.announcement is not None:
                log(job.announcement)
            result = run_job(OmegaConf.create(job.config), sweep_dir / str(job.number))
            if main:
                log(f"[extension job {job.number}] {summary_line(result)}")
            jobs += 1
    return jobs
