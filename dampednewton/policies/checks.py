"""Checks of option values shared by the optimizer and the ViViT computations.

A value of the wrong type raises ``TypeError``, a value of the right type outside its
range ``ValueError``; every message says what is accepted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def check_integer(name: str, value: Any, minimum: int) -> int:
    """Check an integer option (``bool`` is not one).

    Args:
        name: The option's name, for the message.
        value: Its value.
        minimum: The smallest valid value.

    Returns:
        The value.

    Raises:
        TypeError: If it is not an integer.
        ValueError: If it is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


def check_number(name: str, value: Any) -> float:
    """Check that an option is a real number (``bool`` is not one).

    Args:
        name: The option's name, for the message.
        value: Its value.

    Returns:
        The value as a float.

    Raises:
        TypeError: If it is not an ``int`` or ``float``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}.")
    return float(value)


def check_subsampling(indices: Sequence[int] | None, name: str) -> list[int] | None:
    """Check sub-sampling indices: non-negative integers without repetitions.

    Args:
        indices: Sample indices or ``None`` (all samples).
        name: Argument name for the error message.

    Returns:
        The indices as a list, or ``None``.

    Raises:
        ValueError: If the indices are empty, negative or repeated.
        TypeError: If the indices are no sequence, or an index is not an integer.
    """
    if indices is None:
        return None
    try:
        indices = list(indices)
    except TypeError:
        raise TypeError(
            f"{name} must be a sequence of sample indices (e.g. range(32)) or None, "
            f"got {indices!r}."
        ) from None
    if not indices:
        raise ValueError(f"{name} is empty; use None for all samples.")
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"{name} must hold integers, got {index!r}.")
        if index < 0:
            raise ValueError(f"{name} holds a negative index {index}.")
    if len(set(indices)) != len(indices):
        raise ValueError(
            f"{name} repeats sample indices {indices}: each sample may be used once "
            "(repetitions would silently re-weight the GGN)."
        )
    return indices


def check_warn_small_eigvals(value: Any) -> float:
    """Check the small-eigenvalue warning threshold (a number ``>= 0``).

    Args:
        value: The threshold.

    Returns:
        The threshold as a float.

    Raises:
        TypeError: If it is not a number.
        ValueError: If it is negative or NaN.
    """
    threshold = check_number("warn_small_eigvals", value)
    if not threshold >= 0:
        raise ValueError(f"warn_small_eigvals must be >= 0, got {value!r}.")
    return threshold


def check_newton_fraction(fraction: Any) -> float:
    """Check the Newton fraction: a number in ``(0, 1]``.

    Args:
        fraction: The fraction ``φ`` of the damped Newton step along the kept
            directions.

    Returns:
        The fraction as a float.

    Raises:
        TypeError: If it is not a number.
        ValueError: If it is not in ``(0, 1]``.
    """
    value = check_number("newton_fraction", fraction)
    if not 0 < value <= 1:
        raise ValueError(
            f"newton_fraction must be in (0, 1], got {fraction!r}: the fraction of the "
            "damped Newton step taken along the kept directions (1: the whole step, "
            "as ViViT; smaller values average out the batch's gradient noise; scale "
            "the whole step with lr instead)."
        )
    return value


def check_kl_clip(kl_clip: Any) -> float | None:
    """Check a trust-region radius: ``None`` or a finite number ``> 0``.

    Args:
        kl_clip: The radius ``κ``.

    Returns:
        The radius, or ``None``.

    Raises:
        TypeError: If it is neither ``None`` nor a number.
        ValueError: If it is not finite and positive.
    """
    if kl_clip is None:
        return None
    if isinstance(kl_clip, bool) or not isinstance(kl_clip, int | float):
        raise TypeError(
            f"kl_clip must be None (no trust region) or a number > 0, got {kl_clip!r}."
        )
    if not math.isfinite(kl_clip) or kl_clip <= 0:
        raise ValueError(
            f"kl_clip must be None (no trust region) or a number > 0, got {kl_clip!r}."
        )
    return kl_clip
