"""Schedules that decide at which optimization steps a diagnostic is computed.

A schedule is a small frozen dataclass; calling it with a step (``int ≥ 0``)
returns whether the diagnostic runs at that step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class Schedule(Protocol):
    """Anything that maps a step to "compute now or not"."""

    def __call__(self, step: int) -> bool:
        """Return whether the diagnostic is computed at ``step``."""


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer ≥ 0, got {step!r}.")


@dataclass(frozen=True)
class EveryKSteps:
    """Steps ``start, start + k, start + 2k, …`` (up to ``stop``, inclusive).

    Attributes:
        k: Distance between two tracked steps (``≥ 1``).
        start: First tracked step (``≥ 0``).
        stop: Last step that may be tracked; ``None`` for no limit.
    """

    k: int = 1
    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            TypeError: If a field is not an integer.
            ValueError: If ``k < 1``, ``start < 0`` or ``stop < start``.
        """
        for name in ("k", "start"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an integer, got {value!r}.")
        if self.stop is not None and (
            isinstance(self.stop, bool) or not isinstance(self.stop, int)
        ):
            raise TypeError(f"stop must be an integer or None, got {self.stop!r}.")
        if self.k < 1:
            raise ValueError(f"k must be ≥ 1, got {self.k}.")
        if self.start < 0:
            raise ValueError(f"start must be ≥ 0, got {self.start}.")
        if self.stop is not None and self.stop < self.start:
            raise ValueError(
                f"stop ({self.stop}) must be ≥ start ({self.start}) or None."
            )

    def __call__(self, step: int) -> bool:
        """Return whether ``step`` is tracked.

        Args:
            step: Optimization step (``≥ 0``).

        Returns:
            ``True`` if ``step`` is one of ``start + i·k`` and not after ``stop``.
        """
        _check_step(step)
        if step < self.start or (self.stop is not None and step > self.stop):
            return False
        return (step - self.start) % self.k == 0


@dataclass(frozen=True)
class DecadeSchedule:
    """Steps ``0`` and ``m·10^e`` for every multiplier ``m`` and ``e ≥ 0``.

    The default multipliers ``1, …, 9`` give ``0, 1, …, 9, 10, 20, …, 90, 100,
    200, …``: dense at the start of training, sparse later, a constant number of
    tracked steps per decade. ``multipliers=(1, 2, 5)`` gives ``0, 1, 2, 5, 10, 20,
    50, …``.

    Attributes:
        multipliers: Distinct integers in ``1..9``.
    """

    multipliers: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9)

    def __post_init__(self) -> None:
        """Validate the multipliers.

        Raises:
            ValueError: If a multiplier is outside ``1..9``, repeated, or none given.
        """
        values = tuple(self.multipliers)
        if not values or len(set(values)) != len(values):
            raise ValueError(
                f"multipliers must be distinct and non-empty, got {self.multipliers}."
            )
        if any(not isinstance(m, int) or not 1 <= m <= 9 for m in values):
            raise ValueError(
                f"multipliers must be integers in 1..9, got {self.multipliers}."
            )
        object.__setattr__(self, "multipliers", values)

    def __call__(self, step: int) -> bool:
        """Return whether ``step`` is tracked.

        Args:
            step: Optimization step (``≥ 0``).

        Returns:
            ``True`` for ``0`` and for ``m·10^e``.
        """
        _check_step(step)
        if step == 0:
            return True
        while step % 10 == 0:
            step //= 10
        return step in self.multipliers


@dataclass(frozen=True)
class LogSpacedSchedule:
    """Step ``0`` and ``num`` log-spaced steps from ``1`` to ``max_step``.

    The steps are ``round(max_step^(i/(num−1)))`` for ``i = 0, …, num − 1``
    (duplicates at the start collapse, so fewer than ``num`` steps may result).

    Attributes:
        max_step: Last tracked step (``≥ 1``).
        num: Number of log-spaced points (``≥ 2``).
        steps: The tracked steps, sorted (derived, not an argument).
    """

    max_step: int
    num: int = 50
    steps: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Validate the fields and list the tracked steps.

        Raises:
            ValueError: If ``max_step < 1`` or ``num < 2``.
        """
        if self.max_step < 1:
            raise ValueError(f"max_step must be ≥ 1, got {self.max_step}.")
        if self.num < 2:
            raise ValueError(f"num must be ≥ 2, got {self.num}.")
        exponent = math.log(self.max_step) / (self.num - 1)
        steps = {0} | {round(math.exp(i * exponent)) for i in range(self.num)}
        object.__setattr__(self, "steps", tuple(sorted(steps)))

    def __call__(self, step: int) -> bool:
        """Return whether ``step`` is tracked.

        Args:
            step: Optimization step (``≥ 0``).

        Returns:
            ``True`` if ``step`` is one of ``steps``.
        """
        _check_step(step)
        return step in self.steps
