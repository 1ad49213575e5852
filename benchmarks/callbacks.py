"""Hydra callbacks: a progress bar over a sweep's jobs; grid extension and report.

Both are registered in ``conf/config.yaml`` under ``hydra.callbacks``. With the basic
(sequential) launcher all jobs run in one process, so one callback instance sees every
job of a multirun.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from tqdm import tqdm

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def count_jobs(config: DictConfig) -> int | None:
    """Number of jobs the basic sweeper will launch (``None`` if unknown).

    Args:
        config: The multirun config (with its ``hydra`` node).

    Returns:
        The size of the Cartesian product of sweep parameters and command-line
        overrides, or ``None`` for other sweepers or sweeps that cannot be expanded
        here (e.g. ``glob`` over config groups).
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = config.hydra.sweeper
    if sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    params = [f"{key}={value}" for key, value in (sweeper.get("params") or {}).items()]
    try:
        overrides = OverridesParser.create().parse_overrides(
            params + list(config.hydra.overrides.task)
        )
        batches = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # a sweep we cannot expand without the config loader
        return None
    return sum(len(batch) for batch in batches)


def _format_setting(settings: dict[str, Any]) -> str:
    """``lr=0.1 damping=0.01`` from a settings dict."""
    return " ".join(
        f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in settings.items()
    )


def summary_line(summary: dict[str, Any]) -> str:
    """One line describing a finished job (from :func:`benchmarks.job.run_job`).

    Args:
        summary: The job summary.

    Returns:
        E.g. ``digits_mlp sgd lr=0.1 seed=0: final test accuracy 0.9533, train 3.2 s
        (1.05 ms/step)``.
    """
    setting = summary.get("grid_point") or summary.get("hyperparameters") or {}
    head = (
        f"{summary['problem']} {summary['optimizer']} {_format_setting(setting)} "
        f"seed={summary['seed']}"
    ).replace("  ", " ")
    status = summary["status"]
    if status == "skipped":
        return f"{head}: skipped (grid_point beyond this optimizer's grid)"
    if status == "failed":
        return (
            f"{head}: FAILED {summary['error']} (traceback: {summary['result_file']})"
        )
    if status == "diverged":
        return (
            f"{head}: DIVERGED ({summary['divergence']}) after "
            f"{summary['train_time']:.1f} s"
        )
    step = summary["step_time"]["median"]
    per_step = f" ({1e3 * step:.3g} ms/step)" if step is not None else ""
    final = summary["final"]["test_metric"]
    return (
        f"{head}: final test {summary['metric']} {final:.4g}, "
        f"train {summary['train_time']:.1f} s{per_step}"
    )


class SweepProgress(Callback):
    """Progress bar over the jobs of a multirun, one summary line per finished job."""

    def __init__(self) -> None:
        """Start with no sweep."""
        self._bar: tqdm | None = None
        self._total: int | None = None
        self._done = 0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Open the progress bar."""
        self._total = count_jobs(config)
        self._done = 0
        self._bar = tqdm(
            total=self._total, unit="job", file=sys.stderr, dynamic_ncols=True
        )

    def on_job_end(
        self, config: DictConfig, job_return: JobReturn, **kwargs: Any
    ) -> None:
        """Print the job's summary line and advance the bar."""
        if job_return.status == JobStatus.COMPLETED:
            line = summary_line(job_return.return_value)
        else:
            overrides = list(job_return.overrides or [])
            line = f"job {overrides} raised: {job_return._return_value}"
        if self._bar is None:
            print(line, flush=True)
            return
        self._done += 1
        self._bar.write(f"[{self._done}/{self._total or '?'}] {line}", file=sys.stderr)
        self._bar.update(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def failed_result_files(sweep_dir: Path) -> list[str]:
    """``result.json`` paths of the jobs of a sweep that failed (raised).

    Args:
        sweep_dir: The sweep directory.

    Returns:
        The paths, in job order; diverged runs are results, not failures.
    """
    from benchmarks.aggregate import load_results
    from benchmarks.job import RESULT_FILE

    return [
        str(Path(r["job_dir"], RESULT_FILE).resolve())
        for r in load_results(sweep_dir)
        if r["status"] == "failed"
    ]


class SweepReport(Callback):
    """Extend grids at their edges, then report into ``<sweep dir>/report``.

    The extension (:mod:`benchmarks.extension`, at most ``grid_extension.rounds``
    rounds) runs its jobs in this process, into new numbered job directories.
    The process exits with status 1 when a job failed (its exception is in its
    ``result.json``), after the report; a diverged run is a result, not a failure.
    """

    def on_run_end(
        self, config: DictConfig, job_return: JobReturn, **kwargs: Any
    ) -> None:
        """Say where a single run's ``result.json`` is; exit 1 if the job failed.

        The failure itself, with the same path, is the job's summary line
        (:class:`SweepProgress`).
        """
        if job_return.status != JobStatus.COMPLETED:
            return  # Hydra reports the exception and exits 1 itself
        summary = job_return.return_value
        if summary["status"] == "failed":
            raise SystemExit(1)
        print(f"Result: {summary['result_file']}", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Run the grid extension, write and print the report; exit 1 on failures.

        A failure of the extension or the report also exits 1 (Hydra would turn
        it into a warning), after its traceback and the failed jobs' paths.
        """
        from benchmarks.extension import extend_sweep
        from benchmarks.report import print_locations, write_report

        sweep_dir = Path(config.hydra.sweep.dir)
        report_failed = False
        try:
            extend_sweep(
                sweep_dir,
                config.grid_extension.rounds,
                log=lambda line: print(line, file=sys.stderr, flush=True),
            )
            print_locations(write_report(sweep_dir))
        except Exception:
            traceback.print_exc()
            print(
                f"The report failed (traceback above); the jobs' results are in "
                f"{sweep_dir.resolve()}.",
                file=sys.stderr,
                flush=True,
            )
            report_failed = True
        failed = failed_result_files(sweep_dir)
        if failed:
            print(
                f"{len(failed)} job(s) failed; their errors and tracebacks:",
                *failed,
                sep="\n  ",
                file=sys.stderr,
                flush=True,
            )
        if failed or report_failed:
            raise SystemExit(1)
