"""Damping policies: how much each selected GGN direction is damped.

A damping policy is a callable ``(evals, gram_evecs, gammas, lambdas) -> δ`` (ViViT's
convention) returning one non-negative damping per selected direction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

Damping = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass
class ConstantDamping:
    """The same damping ``δ_k = value`` for every direction.

    Attributes:
        value: Non-negative damping.
    """

    value: float

    def __post_init__(self) -> None:
        """Validate the value."""
        if not math.isfinite(self.value) or self.value < 0:
            raise ValueError(
                f"Damping must be finite and >= 0, got {self.value!r}. Use 0 for an "
                "undamped Newton step along the selected directions."
            )

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return ``value`` for every direction."""
        return torch.full_like(evals, self.value)


def as_damping(damping: float | Damping) -> Damping:
    """Turn the shorthand ``float`` into :class:`ConstantDamping`; pass callables.

    Args:
        damping: A non-negative number or a callable damping policy.

    Returns:
        A callable damping policy.

    Raises:
        ValueError: For a negative or non-finite number.
        TypeError: For anything that is neither a number nor callable.
    """
    if isinstance(damping, int | float) and not isinstance(damping, bool):
        return ConstantDamping(float(damping))
    if callable(damping):
        return damping
    raise TypeError(
        "damping must be a number >= 0 or a callable (evals, gram_evecs, gammas, "
        f"lambdas) -> δ, got {type(damping).__name__}."
    )


def checked_damping(damping: Tensor, num_directions: int) -> Tensor:
    """Check a policy's output: one finite, non-negative value per direction.

    Args:
        damping: What the policy returned.
        num_directions: Number of selected directions ``K``.

    Returns:
        The damping as a 1d tensor.

    Raises:
        ValueError: If the shape is wrong or a value is negative or not finite.
    """
    damping = torch.as_tensor(damping)
    if damping.shape != (num_directions,):
        raise ValueError(
            f"The damping policy returned shape {tuple(damping.shape)}, expected "
            f"({num_directions},): one value per selected direction."
        )
    if not torch.isfinite(damping).all() or (damping < 0).any():
        raise ValueError(
            f"The damping policy returned invalid values {damping.tolist()}: damping "
            "must be finite and >= 0."
        )
    return damping


# Policies live in param groups: let `torch.load(weights_only=True)` restore them.
torch.serialization.add_safe_globals([ConstantDamping])
