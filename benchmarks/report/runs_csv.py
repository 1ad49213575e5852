"""The CSV of a sweep: one row per run, every recorded field."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from benchmarks.sweep.result import FinalMetrics, RunResult

CSV_COLUMNS = [
    "problem",
    "optimizer",
    "seed",
    "status",
    "hyperparameters",
    "metric",
    "final_test_metric",
    "final_test_loss",
    "final_train_loss",
    "best_test_metric",
    "targets",
    "median_step_time",
    "train_time",
    "peak_memory_mb",
    "memory_kind",
    "device",
    "world_size",
    "communication_per_step",
    "divergence",
    "extended_from",
    "error",
    "job_dir",
]


def _csv_row(result: RunResult) -> dict[str, Any]:
    """Flatten one result into a CSV row."""
    final = result.final or FinalMetrics()
    return {
        "problem": result.problem,
        "optimizer": result.optimizer,
        "seed": result.seed,
        "status": result.status,
        "hyperparameters": json.dumps(result.hyperparameters, sort_keys=True),
        "metric": result.metric,
        "final_test_metric": final.test_metric,
        "final_test_loss": final.test_loss,
        "final_train_loss": final.train_loss,
        "best_test_metric": result.best_test_metric,
        "targets": json.dumps(result.targets if result.trained else None),
        **{
            f"{key}_{i + 1}": value
            for key in ("steps_to_target", "time_to_target")
            for i, value in enumerate(getattr(result, key))
        },
        "median_step_time": result.step_time and result.step_time.median,
        "train_time": result.train_time,
        "peak_memory_mb": result.memory and result.memory.peak_mb,
        "memory_kind": result.memory and result.memory.kind,
        "device": result.device,
        "world_size": result.world_size,
        "communication_per_step": result.communication_per_step,
        "divergence": result.divergence,
        "extended_from": json.dumps(result.extended_from),
        "error": result.error,
        "job_dir": result.job_dir,
    }


def write_csv(results: list[RunResult], path: Path) -> Path:
    """One row per run; ``steps_to_target_<i>``/``time_to_target_<i>`` per target.

    Args:
        results: Loaded results.
        path: Output file.

    Returns:
        ``path``.
    """
    with open(path, "w", newline="") as f:
        num_targets = max(len(r.targets) for r in results)
        per_target = [
            f"{key}_{i + 1}"
            for i in range(num_targets)
            for key in ("steps_to_target", "time_to_target")
        ]
        column = CSV_COLUMNS.index("targets") + 1
        fieldnames = CSV_COLUMNS[:column] + per_target + CSV_COLUMNS[column:]
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(_csv_row(r) for r in results)
    return path
