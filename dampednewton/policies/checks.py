"""Checks of option values shared by the optimizer and the ViViT computations.

A value of the wrong type raises ``TypeError``, a value of the right type outside its
range ``ValueError``; every message says what is accepted.
"""

from __future__ import annotations

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
        TypeError: If an index is not an integer.
    """
    if indices is None:
        return None
    indices = list(indices)
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
