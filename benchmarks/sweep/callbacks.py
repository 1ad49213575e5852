"""Hydra callbacks: a progress bar over a sweep's jobs; grid extension and report.

Both are registered in ``conf/config.yaml`` under ``hydra.callbacks``. With the basic
(sequential) launcher all jobs run in one process, so one callback instance sees every
job of a multirun.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from tqdm import tqdm

from benchmarks.sweep.data_parallel import (
    broadcast_from_rank_0,
    in_process_group,
    launched_rank,
    launched_world_size,
)
from benchmarks.sweep.eta import format_duration, remaining_seconds
from benchmarks.sweep.result import RunResult, recorded
from benchmarks.sweep.sweep_plan import SweepPlan

# tqdm's bar with the cost-weighted ETA (the postfix) in place of its rate-based one.
ETA_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def _format_setting(settings: dict[str, Any]) -> str:
    """``lr=0.1 damping=0.01`` from a settings dict."""
    return " ".join(
        f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in settings.items()
    )


def summary_line(result: RunResult) -> str:
    """One line describing a finished job (from :func:`benchmarks.sweep.job.run_job`).

    Args:
        result: The job's record.

    Returns:
        E.g. ``digits_mlp sgd lr=0.1 seed=0: final test accuracy 0.9533, train 3.2 s
        (1.05 ms/step)``.
    """
    setting = result.grid_point or result.hyperparameters or {}
    head = (
        f"{result.problem} {result.optimizer} {_format_setting(setting)} "
        f"seed={result.seed}"
    ).replace("  ", " ")
    if result.resumed:
        return f"{head}: already done ({result.status}), kept {result.result_file}"
    if result.status == "skipped":
        return f"{head}: skipped ({result.skip_reason})"
    if result.status == "failed":
        return f"{head}: FAILED {result.error} (traceback: {result.result_file})"
    if result.status == "diverged":
        label = "AT CHANCE LEVEL" if result.at_chance_level else "DIVERGED"
        return f"{head}: {label} ({result.divergence}) after {result.train_time:.1f} s"
    step = recorded(result.step_time, "step_time").median
    per_step = f" ({1e3 * step:.3g} ms/step)" if step is not None else ""
    final = recorded(result.final, "final")
    return (
        f"{head}: final test {result.metric} {final.test_metric:.4g}, "
        f"train {result.train_time:.1f} s{per_step}"
    )


class SweepProgress(Callback):
    """Progress bar over the jobs of a multirun, one summary line per finished job.

    At the start it prints the number of jobs and the expected time; the bar's
    ETA weighs every pending job by its kind's cost (:mod:`benchmarks.sweep.eta`), not
    by the average of the jobs so far. The sweep's first job, which also pays
    one-off imports and data loading, is left out of the measured times.
    """

    def __init__(self) -> None:
        """Start with no sweep."""
        self._bar: tqdm | None = None
        self._plan: SweepPlan | None = None
        self._durations: dict[tuple[str, ...], list[float]] = defaultdict(list)
        self._job_start = 0.0
        self._done = 0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Print the plan and open the progress bar (rank 0 only under torchrun)."""
        if launched_rank() != 0:
            return
        self._plan = SweepPlan.of(config)
        self._durations.clear()
        self._done = 0
        if self._plan is not None:
            print(self._plan.describe(), file=sys.stderr, flush=True)
        # Printed first, so that an interrupted sweep can be resumed or reported.
        print(
            f"Sweep folder: {Path(config.hydra.sweep.dir).resolve()}",
            file=sys.stderr,
            flush=True,
        )
        self._bar = tqdm(
            total=None if self._plan is None else len(self._plan.kinds),
            unit="job",
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format=None if self._plan is None else ETA_BAR_FORMAT,
        )
        self._show_eta()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Start the job's clock."""
        self._job_start = time.perf_counter()

    def on_job_end(
        self, config: DictConfig, job_return: JobReturn, **kwargs: Any
    ) -> None:
        """Print the job's summary line and advance the bar (rank 0 only)."""
        if launched_rank() != 0:
            return
        resumed = False  # kept from an earlier run: no time to measure
        try:  # `return_value` raises the job's exception when it failed
            line = summary_line(job_return.return_value)
            resumed = job_return.return_value.resumed
        except Exception as err:
            overrides = list(job_return.overrides or [])
            line = f"job {overrides} raised: {err}"
        if self._bar is None:
            print(line, flush=True)
            return
        # The first job also pays one-off imports and data loading; the sequential
        # launcher runs the jobs in the plan's order.
        if (
            self._plan is not None
            and 0 < self._done < len(self._plan.kinds)
            and not resumed
        ):
            kind = self._plan.kinds[self._done]
            self._durations[kind].append(time.perf_counter() - self._job_start)
        self._done += 1
        total = self._bar.total or "?"
        self._bar.write(f"[{self._done}/{total}] {line}", file=sys.stderr)
        self._show_eta()
        self._bar.update(1)

    def _show_eta(self) -> None:
        """Put the cost-weighted estimate of the remaining time on the bar."""
        if self._plan is None or self._bar is None:
            return
        pending = self._plan.kinds[self._done :]
        seconds = remaining_seconds(pending, self._durations, self._plan.prior)
        self._bar.set_postfix_str(f"ETA {format_duration(seconds)}", refresh=False)

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
    from benchmarks.report.loading import load_results

    try:
        results = load_results(sweep_dir)
    except FileNotFoundError:  # no job ran: none failed
        return []
    return [str(r.result_file) for r in results if r.status == "failed"]


class SweepReport(Callback):
    """Extend grids at their edges, then report into ``<sweep dir>/report``.

    The extension (:mod:`benchmarks.sweep.grid_extension`, at most
    ``grid_extension.rounds`` rounds) runs its jobs in this process, into new
    numbered job directories.
    The process exits with status 1 when a job failed (its exception is in its
    ``result.json``), after the report; a diverged run is a result, not a failure.
    Under ``torchrun`` every rank runs the extension's jobs (rank 0 plans them) and
    rank 0 alone reports.
    """

    # Hydra declares on_run_end(config, **kwargs) and passes job_return by keyword.
    def on_run_end(  # type: ignore[override]
        self, config: DictConfig, job_return: JobReturn, **kwargs: Any
    ) -> None:
        """Say where a single run's ``result.json`` is; exit 1 if the job failed.

        The failure itself, with the same path, is the job's summary line
        (:class:`SweepProgress`).
        """
        if job_return.status != JobStatus.COMPLETED:
            return  # Hydra reports the exception and exits 1 itself
        result: RunResult = job_return.return_value
        if result.status == "failed":
            raise SystemExit(1)
        if launched_rank() != 0:
            return  # only rank 0 wrote the result
        print(f"Result: {result.result_file}", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Run the grid extension, write and print the report; exit 1 on failures.

        A failure of the extension or the report also exits 1 (Hydra would turn
        it into a warning), after its traceback and the failed jobs' paths.
        """
        from benchmarks.report.report import print_locations, write_report
        from benchmarks.sweep.grid_extension import extend_sweep

        sweep_dir = Path(config.hydra.sweep.dir)
        report_failed = False
        data_parallel = launched_world_size() > 1
        # Under torchrun every rank runs rank 0's extension jobs; with no job
        # joined, no job trained (all skipped), so there is nothing to extend.
        extendable = in_process_group() or not data_parallel
        try:
            extend_sweep(
                sweep_dir,
                config.grid_extension.rounds if extendable else 0,
                log=lambda line: print(line, file=sys.stderr, flush=True),
                share=broadcast_from_rank_0 if data_parallel else None,
            )
            if launched_rank() != 0:
                return  # rank 0 reports
            print_locations(write_report(sweep_dir))
        except FileNotFoundError as error:  # no job ran: say so, no traceback
            print(error, file=sys.stderr, flush=True)
            report_failed = True
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
