"""Validation shared by the diagnostic specs (each raises with an actionable text)."""

from __future__ import annotations

import math

from dampednewton.diagnostics.bin_adaptation import RangePolicy
from dampednewton.diagnostics.schedules import Schedule


def check_label(label: str) -> None:
    """Raise ``ValueError`` unless ``label`` is a non-empty string without ``/``."""
    if not isinstance(label, str) or not label or "/" in label:
        raise ValueError(
            f"label must be a non-empty string without '/', got {label!r}."
        )


def check_schedule(schedule: Schedule) -> None:
    """Raise ``TypeError`` unless ``schedule`` is callable as ``schedule(step)``."""
    if not callable(schedule):
        raise TypeError(
            f"schedule must be callable as schedule(step) -> bool, got {schedule!r}."
        )


def check_policy(name: str, policy: RangePolicy) -> None:
    """Raise ``TypeError`` unless ``policy`` has a ``compute(values)`` method."""
    if not callable(getattr(policy, "compute", None)):
        raise TypeError(
            f"{name} must be a range policy with a compute(values) method (e.g. "
            f"FixedRange, MaxAbsRange, PercentileRange), got {policy!r}."
        )


def check_range(name: str, value: tuple[float, float]) -> tuple[float, float]:
    """Return ``value`` as floats; raise ``ValueError`` unless finite ``low < high``."""
    low, high = (float(v) for v in value)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(
            f"{name} must be (low, high), finite, with low < high, got {value}."
        )
    return (low, high)


def check_count(name: str, count: int) -> None:
    """Raise ``ValueError`` unless ``count`` is an integer ``≥ 1``."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{name} must be an integer ≥ 1, got {count!r}.")
