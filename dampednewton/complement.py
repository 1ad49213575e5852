r"""The complement step: curvature policies and its pure tensor math.

ViViT's step moves only inside the span of the selected GGN eigenvectors ``e_k`` and
throws away the part of the mean gradient ``ḡ`` outside it. The complement step also
moves along that part, treating the GGN there as the constant curvature ``ρ`` (the
damped inverse of the low-rank GGN, as in Nyström PCG and SketchySGD):

.. math::

    s = \sum_k \frac{-\bar\gamma_k}{\bar\lambda_k + \delta_k} e_k
        - \frac{1}{\rho}\Big(\bar g - \sum_k (\bar g^\top e_k) e_k\Big).

With ``p_k = ḡᵀe_k`` the step is ``Σ_k (c_k + p_k/ρ) e_k − ḡ/ρ``: one map of the
directions plus a multiple of the gradient. ``ρ`` comes from a policy:
:class:`SmallestCurvature` (the default: the smallest kept ``λ̄_k + δ_k``, so that the
complement is never stepped along more boldly than the flattest kept direction) or
:class:`ConstantCurvature`; ``None`` switches the complement off (ViViT's step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class ComplementPolicy(Protocol):
    """Maps the kept directions' curvatures and dampings to ``ρ`` (or ``None``)."""

    def __call__(self, lambda_mean: Tensor, damping: Tensor) -> Tensor | None:
        """Return ``ρ > 0`` as a scalar tensor, or ``None`` for no complement step."""


@dataclass(frozen=True)
class SmallestCurvature:
    """``ρ = min_k (λ̄_k + δ_k)`` over the kept directions (those with finite ``δ_k``).

    Without a kept direction there is no curvature to borrow and no complement step.
    """

    def __call__(self, lambda_mean: Tensor, damping: Tensor) -> Tensor | None:
        """Return the smallest damped curvature, or ``None`` without directions."""
        damped = lambda_mean + damping
        kept = damped[torch.isfinite(damped)]
        if kept.numel() == 0:
            return None
        return kept.min()


@dataclass(frozen=True)
class ConstantCurvature:
    """A fixed curvature ``ρ > 0`` for the complement.

    Attributes:
        value: The curvature ``ρ`` (the complement step is ``−g_⊥/ρ``).
    """

    value: float

    def __post_init__(self) -> None:
        """Validate ``value``."""
        if (
            isinstance(self.value, bool)
            or not isinstance(self.value, int | float)
            or not math.isfinite(self.value)
            or self.value <= 0
        ):
            raise ValueError(
                f"The complement curvature must be a finite number > 0, got "
                f"{self.value!r} (use complement=None to switch the complement off)."
            )

    def __call__(self, lambda_mean: Tensor, damping: Tensor) -> Tensor:
        """Return ``ρ`` as a tensor."""
        return torch.tensor(float(self.value), dtype=lambda_mean.dtype)


def as_complement(
    complement: float | ComplementPolicy | None,
) -> ComplementPolicy | None:
    """Turn the shorthand ``float`` into :class:`ConstantCurvature`; pass policies.

    Args:
        complement: ``None`` (off), a number ``ρ > 0``, or a policy.

    Returns:
        The policy, or ``None``.

    Raises:
        ValueError: For a number that is not finite and positive.
        TypeError: For anything else that is not callable.
    """
    if complement is None:
        return None
    if isinstance(complement, int | float) and not isinstance(complement, bool):
        return ConstantCurvature(float(complement))
    if callable(complement):
        return complement
    raise TypeError(
        "complement must be None, a number > 0 or a policy such as "
        f"SmallestCurvature(), got {type(complement).__name__}."
    )


def orthogonal_energy(gradient_sq_norm: Tensor, projections: Tensor) -> Tensor:
    """``‖ḡ − Σ_k p_k e_k‖² = ‖ḡ‖² − Σ_k p_k²`` for orthonormal ``e_k`` (clamped at 0).

    Args:
        gradient_sq_norm: ``‖ḡ‖²`` (scalar).
        projections: ``p_k = ḡᵀ e_k`` ``[K]``.

    Returns:
        The squared norm of the gradient outside the directions (scalar).
    """
    return (gradient_sq_norm - projections.square().sum()).clamp_min(0)


def complement_coefficients(
    coefficients: Tensor, projections: Tensor, curvature: Tensor
) -> Tensor:
    """Coefficients ``c_k + p_k/ρ`` of the directions in ``Σ_k (…) e_k − ḡ/ρ``.

    Args:
        coefficients: Newton coefficients ``c_k`` ``[K]``.
        projections: ``p_k = ḡᵀ e_k`` ``[K]``.
        curvature: ``ρ`` (scalar).

    Returns:
        ``[K]`` coefficients.
    """
    return coefficients + projections / curvature


# Policies live in param groups: let `torch.load(weights_only=True)` restore them.
torch.serialization.add_safe_globals([SmallestCurvature, ConstantCurvature])
