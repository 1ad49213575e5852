"""Hand-made run results (the fields ``run_job`` writes) for the report's tests."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.sweep.result import RunResult


def made_result(
    optimizer: str,
    seed: int,
    steps: Sequence[int | None],
    *,
    seconds: Sequence[float | None] | None = None,
    final: float = 0.9,
    step_time: float = 0.01,
    lr: float = 1.0,
) -> RunResult:
    """A trained run on problem ``p`` with accuracy targets 0.5 and 0.9.

    Args:
        optimizer: The optimizer's name.
        seed: The seed.
        steps: Steps to each target (``None``: never reached).
        seconds: Time to each target; ``None``: ``steps / 100`` (10 ms a step).
        final: Final (and best) test accuracy.
        step_time: Median seconds per step.
        lr: The learning rate (the grid point).

    Returns:
        The result.
    """
    if seconds is None:
        seconds = [None if s is None else s / 100 for s in steps]
    return RunResult.from_json(
        {
            "problem": "p",
            "optimizer": optimizer,
            "seed": seed,
            "status": "ok",
            "hyperparameters": {"lr": lr},
            "maximize": True,
            "metric": "accuracy",
            "targets": [0.5, 0.9],
            "final": {"test_metric": final, "test_loss": 0.3, "train_loss": 0.2},
            "best": {"test_metric": final},
            "steps_to_target": list(steps),
            "time_to_target": list(seconds),
            "step_time": {"median": step_time},
        }
    )
