"""What a multirun will launch, and how long it should take, before its first job.

Hydra's basic sweeper launches the Cartesian product of its sweep parameters
(``hydra.sweeper.params``) and the command-line overrides, first key slowest. This
module expands the forms the presets use, comma lists and ``range(...)``, itself; a
sweep written with other forms (``glob``, ``choice``, quoting) has no plan, and the
progress bar then runs without a total. Each kind of job
(:func:`benchmarks.sweep.eta.job_kind`) is composed once with Hydra's public compose API
for its cost prior and name.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from benchmarks.sweep.config_dict import config_dict
from benchmarks.sweep.eta import (
    format_duration,
    job_kind,
    prior_seconds,
    remaining_seconds,
)
from benchmarks.sweep.grid import grid_size, skip_reason

_RANGE = re.compile(r"range\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?(?:,\s*(-?\d+)\s*)?\)")
#: Characters of override values this expansion does not parse (quoting, escapes,
#: sweep functions other than ``range``, interpolations).
_UNPARSED = set("()'\"\\$")
_RULE_NOT_TAKEN = "a damping rule they do not take"
_BEYOND_GRID = "grid_point beyond their optimizer's grid"


def _sweep_values(value: str) -> list[str] | None:
    """The values of one override value: ``a,b`` → two, ``range(3)`` → three.

    Lists and dicts (``[0.5,0.9]``) are one value each.

    Args:
        value: The text right of ``=``.

    Returns:
        The values as override text, or ``None`` for a form not parsed here.
    """
    value = value.strip()
    match = _RANGE.fullmatch(value)
    if match:
        numbers = [int(n) for n in match.groups() if n is not None]
        return [str(n) for n in range(*numbers)]
    if _UNPARSED & set(value):
        return None
    parts, depth, start = [], 0, 0
    for index, char in enumerate(value):  # commas inside [...] or {...} stay
        depth += (char in "[{") - (char in "]}")
        if char == "," and depth == 0:
            parts.append(value[start:index])
            start = index + 1
    return [part.strip() for part in [*parts, value[start:]]]


def expand_sweep(
    params: Mapping[str, str], overrides: Sequence[str]
) -> list[list[str]] | None:
    """Every job's overrides, in the basic sweeper's launch order.

    As the basic sweeper does: sweep parameters first, then the command-line
    overrides; a later override of the same key replaces the earlier one's values in
    its place; the product runs with the first key slowest.

    Args:
        params: ``hydra.sweeper.params`` (key → value text).
        overrides: The command-line overrides (``hydra.overrides.task``).

    Returns:
        One list of ``key=value`` overrides per job, or ``None`` when a value has a
        form not parsed here.
    """
    axes: dict[str, list[str]] = {}
    for text in [f"{key}={value}" for key, value in params.items()] + list(overrides):
        key, sep, value = text.partition("=")
        values = _sweep_values(value) if sep else None
        if values is None:
            return None
        axes[key.lstrip("+~")] = [f"{key}={v}" for v in values]
    return [list(job) for job in itertools.product(*axes.values())]


def compose_job(config: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Compose the config of one job of the multirun (Hydra's public compose API).

    ``${hydra:...}`` interpolations (``optimizer_name``) read the Hydra config of
    the job composed here; it is set for this call only.

    Args:
        config: The multirun config (with its ``hydra`` node).
        overrides: The job's overrides.

    Returns:
        The job config, resolved, without its ``hydra`` node.
    """
    job = compose(
        config.hydra.job.config_name,
        overrides=list(overrides),
        return_hydra_config=True,
    )
    HydraConfig.instance().set_config(job)
    try:
        with open_dict(job):
            del job["hydra"]
        return OmegaConf.create(config_dict(job, resolve=True))
    finally:
        HydraConfig.instance().set_config(config)


def _grid_point(job: Sequence[str]) -> int | None:
    """The job's ``grid_point`` override (the last one), ``None`` without one."""
    values = [o.split("=", 1)[1] for o in job if o.split("=", 1)[0] == "grid_point"]
    return int(values[-1]) if values and values[-1].lstrip("-").isdigit() else None


@dataclass
class SweepPlan:
    """The jobs of a multirun with their kinds and prior costs.

    The costs come from :mod:`benchmarks.sweep.eta`.

    Attributes:
        kinds: The kind of every job, in launch order (a job beyond its grid has
            a kind of its own).
        prior: Kind → prior seconds of one job (0 for a kind that is skipped).
        names: Kind → ``"<optimizer> on <problem>"`` (kinds that run only).
        skipped: Kind → why its jobs are skipped (kinds that are).
    """

    kinds: list[tuple[str, ...]]
    prior: dict[tuple[str, ...], float]
    names: dict[tuple[str, ...], str]
    skipped: dict[tuple[str, ...], str]

    @classmethod
    def of(cls, config: DictConfig) -> SweepPlan | None:
        """Plan the multirun of ``config``.

        Args:
            config: The multirun config (with its ``hydra`` node).

        Returns:
            The plan, or ``None`` for a sweeper other than the basic one or a sweep
            that cannot be expanded here.
        """
        if config.hydra.runtime.choices.get("hydra/sweeper") != "basic":
            return None
        params = config.hydra.sweeper.get("params") or {}
        jobs = expand_sweep(
            {key: str(value) for key, value in params.items()},
            list(config.hydra.overrides.task),
        )
        if jobs is None:
            return None
        kinds = [job_kind(job) for job in jobs]
        prior, names, skipped, sizes = {}, {}, {}, {}
        for kind, job in dict(zip(kinds, jobs, strict=True)).items():
            job_config = compose_job(config, job)
            if skip_reason(job_config) is not None:
                prior[kind], skipped[kind] = 0.0, _RULE_NOT_TAKEN
                continue
            prior[kind] = prior_seconds(job_config)
            names[kind] = f"{job_config.optimizer_name} on {job_config.problem.name}"
            sizes[kind] = grid_size(job_config)
        for index, job in enumerate(jobs):
            size, point = sizes.get(kinds[index]), _grid_point(job)
            if size is not None and point is not None and point >= size:
                kinds[index] = beyond = (*kinds[index], _BEYOND_GRID)
                prior[beyond], skipped[beyond] = 0.0, _BEYOND_GRID
        return cls(kinds, prior, names, skipped)

    def describe(self) -> str:
        """What will run and how long it should take, from the priors alone.

        Returns:
            E.g. ``36 jobs (12 sgd on digits_mlp, ...): about 45 s by the cost
            priors ...``.
        """
        counts = Counter(self.names[kind] for kind in self.kinds if kind in self.names)
        reasons = Counter(self.skipped[k] for k in self.kinds if k in self.skipped)
        total = remaining_seconds(self.kinds, {}, self.prior)
        parts = [f"{n} {name}" for name, n in counts.items()]
        parts += [f"{n} skipped: {reason}" for reason, n in reasons.items()]
        return (
            f"{len(self.kinds)} jobs ("
            + ", ".join(parts)
            + f"): about {format_duration(total)} on an idle CPU thread by the "
            "configs' cost priors (problem.cost_prior, step_cost_prior), plus "
            "start-up, grid extensions and the report; the progress bar's ETA "
            "follows the measured times per kind of job."
        )
