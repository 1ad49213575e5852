"""Checks of a damping policy's values: shape ``[K]``, finite and ``>= 0``.

A policy's output is checked on the device (:func:`valid_damping_flag`) and read
with the step's other checks; :func:`invalid_damping_error` says what was wrong.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dampednewton.policies.damping import ConstantDamping, Damping, LevenbergMarquardt


def checked_damping(damping: Tensor, num_directions: int) -> Tensor:
    """Check a policy's output: one finite, non-negative value per direction.

    Args:
        damping: What the policy returned.
        num_directions: Number of selected directions ``K``.

    Returns:
        The damping as a 1d tensor.

    Raises:
        ValueError: If the shape is wrong or a value is negative or NaN.
    """
    damping = checked_damping_shape(damping, num_directions)
    if not bool(valid_damping_flag(damping)):
        raise invalid_damping_error(damping)
    return damping


def checked_damping_shape(damping: Tensor, num_directions: int) -> Tensor:
    """Check only the shape of a policy's output (known on the host: no sync).

    Args:
        damping: What the policy returned.
        num_directions: Number of selected directions ``K``.

    Returns:
        The damping as a 1d tensor.

    Raises:
        ValueError: If the shape is not ``(K,)``.
    """
    damping = torch.as_tensor(damping)
    if damping.shape != (num_directions,):
        raise ValueError(
            f"The damping policy returned shape {tuple(damping.shape)}, expected "
            f"({num_directions},): one value per selected direction."
        )
    return damping


def valid_damping_flag(damping: Tensor) -> Tensor:
    """Whether no value is negative or NaN, as a 0-dim tensor (no sync).

    Args:
        damping: A policy's output ``[K]``.

    Returns:
        A boolean 0-dim tensor (``inf`` is valid: it drops a direction).
    """
    return (damping >= 0).all()


def invalid_damping_error(damping: Tensor) -> ValueError:
    """The error for a policy's output with negative or NaN values.

    Args:
        damping: The invalid output.

    Returns:
        The error to raise.
    """
    return ValueError(
        f"The damping policy returned invalid values {damping.tolist()}: damping "
        "must be >= 0 (inf drops a direction)."
    )


def trusts_its_values(damping: Damping) -> bool:
    """Whether a policy's values are valid by construction (checked when set).

    A constant and Levenberg-Marquardt's current value are validated when they
    are set; the other policies compute theirs from the batch, so their output is
    checked at every step.

    Args:
        damping: The group's policy.

    Returns:
        ``True`` for :class:`ConstantDamping` and :class:`LevenbergMarquardt`.
    """
    return isinstance(damping, ConstantDamping | LevenbergMarquardt)
