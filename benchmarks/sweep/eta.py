"""How long a sweep's jobs will take: cost priors, refined by the jobs that finished.

Jobs of a sweep differ widely in cost (a damped Newton step costs many SGD steps),
and Hydra's basic sweeper runs them grouped by optimizer, so a rate averaged over
the finished jobs says little about the rest. The estimate here is per *kind* of job
(the job's overrides without ``seed`` and ``grid_point``, which change neither the
problem nor the optimizer's cost): a kind with finished jobs takes their mean time;
a kind without takes its prior (:func:`prior_seconds`), scaled by how much slower or
faster than their priors the finished jobs ran on this machine.

The priors come from the configs: ``problem.cost_prior`` (seconds per SGD step and
per evaluation on one CPU thread) and the optimizer's ``step_cost_prior`` (its time
per step over SGD's).
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from omegaconf import DictConfig

KindT = TypeVar("KindT", bound=Hashable)
"""A kind of job (e.g. :func:`job_kind`'s tuple)."""

#: Seconds per job outside training and evaluation on CPU: Hydra's job set-up,
#: building the model, writing ``result.json`` (measured on the default sweep).
JOB_OVERHEAD_SECONDS = 0.4

#: Overrides that change neither the problem nor the optimizer's cost per step.
COST_NEUTRAL_KEYS = ("seed", "grid_point")


def job_kind(overrides: Sequence[str]) -> tuple[str, ...]:
    """The overrides of a job that can change its cost (``seed`` etc. dropped).

    Args:
        overrides: The job's overrides, ``key=value`` strings.

    Returns:
        The others, in their order.
    """
    return tuple(
        o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in COST_NEUTRAL_KEYS
    )


def prior_seconds(cfg: DictConfig) -> float:
    """Expected seconds of a job on one CPU thread, from the config's cost priors.

    ``overhead + evaluations · problem.cost_prior.evaluation + steps ·
    problem.cost_prior.sgd_step · step_cost_prior``, with ``steps // eval_every + 1``
    evaluations.

    Args:
        cfg: The composed job config.

    Returns:
        Seconds.
    """
    problem = cfg.problem
    evaluations = problem.steps // problem.eval_every + 1
    return (
        JOB_OVERHEAD_SECONDS
        + evaluations * problem.cost_prior.evaluation
        + problem.steps * problem.cost_prior.sgd_step * cfg.step_cost_prior
    )


def remaining_seconds(
    pending: Sequence[KindT],
    durations: Mapping[KindT, Sequence[float]],
    prior: Mapping[KindT, float],
) -> float:
    """Seconds the pending jobs will take.

    Args:
        pending: The kind of every job still to run.
        durations: Kind → seconds of its finished jobs.
        prior: Kind → prior seconds of one job (every pending kind).

    Returns:
        The sum over pending jobs of their kind's mean finished duration, or, for a
        kind with no finished job, its prior times the ratio of the finished jobs'
        total time to their total prior (1 before any job finished).
    """
    measured = {kind: statistics.fmean(d) for kind, d in durations.items() if d}
    spent = sum(sum(d) for d in durations.values())
    expected = sum(prior[kind] * len(d) for kind, d in durations.items())
    machine_speed = spent / expected if spent > 0 and expected > 0 else 1.0
    return sum(measured.get(kind, prior[kind] * machine_speed) for kind in pending)


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"3 min 20 s"``, ``"1 h 05 min"``: rounded to what matters.

    Args:
        seconds: A non-negative duration.

    Returns:
        The text.
    """
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
