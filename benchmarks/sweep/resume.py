"""Resuming a sweep: keep the complete results of an earlier run, rerun the rest.

Rerunning a multirun with the same ``hydra.sweep.dir`` (and the same command) runs
every job again through :func:`benchmarks.sweep.job.run_job`, which first asks
:func:`finished_result` whether the job directory already holds this job's complete
result: ``result.json`` parses into a :class:`~benchmarks.sweep.result.RunResult` whose
``overrides`` and ``config`` are the job's own, with a status other than
``"failed"``. Such a job is not run again; a missing, damaged (cut off, unreadable),
foreign (another job's overrides or config) or failed result is rerun and replaced.
Results are written atomically (:mod:`benchmarks.sweep.atomic`), so a cut-off
``result.json`` only comes from outside damage; a job stopped mid-run leaves none.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.sweep.result import RESULT_FILE, RunResult, finite_or_none


def read_result(path: Path) -> RunResult | None:
    """A ``result.json`` as a record, ``None`` when it is missing or damaged.

    Args:
        path: The file.

    Returns:
        The record, or ``None`` if the file is absent or does not parse into one.
    """
    try:
        return RunResult.read(path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # absent, cut off (JSONDecodeError), or not a RunResult


def finished_result(
    job_dir: Path, config: dict[str, Any], overrides: Sequence[str]
) -> RunResult | None:
    """The job's result from an earlier run of the sweep, if complete and its own.

    Args:
        job_dir: The job's directory.
        config: The job's resolved config (as :func:`benchmarks.sweep.job.run_job`
            records it).
        overrides: The job's Hydra overrides (``()`` for a grid-extension job).

    Returns:
        The stored record (``resumed`` set), or ``None``: run the job.
    """
    result = read_result(job_dir / RESULT_FILE)
    if (
        result is None
        or result.status == "failed"
        or result.overrides != list(overrides)
        or result.config != finite_or_none(config)
    ):
        return None
    result.resumed = True
    return result


def sweep_results(sweep_dir: Path) -> dict[int, RunResult]:
    """The readable results of a sweep's numbered job directories, skipped included.

    Args:
        sweep_dir: The sweep directory.

    Returns:
        Job number → record; damaged or missing results are left out.
    """
    found = {}
    for job_dir in Path(sweep_dir).iterdir():
        if job_dir.name.isdigit():
            result = read_result(job_dir / RESULT_FILE)
            if result is not None:
                found[int(job_dir.name)] = result
    return found
