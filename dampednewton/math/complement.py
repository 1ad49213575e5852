"""The complement step's terms: the gradient outside the kept directions (pure math).

With orthonormal kept directions ``e_k`` and the gradient's projections
``p_k = ḡᵀe_k``, the complement is ``g_⊥ = ḡ − Σ_k p_k e_k``. The complement step
``−g_⊥/ρ`` needs its energy ``‖g_⊥‖²`` and, to measure the curvature there, the batch
GGN's Rayleigh quotient along it from ``Vᵀg_⊥``
(:mod:`dampednewton.policies.complement` picks ``ρ``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor


def orthogonal_energy(gradient_sq_norm: Tensor, projections: Tensor) -> Tensor:
    """``‖ḡ − Σ_k p_k e_k‖² = ‖ḡ‖² − Σ_k p_k²`` for orthonormal ``e_k`` (clamped at 0).

    Args:
        gradient_sq_norm: ``‖ḡ‖²`` (scalar).
        projections: ``p_k = ḡᵀ e_k`` ``[K]``.

    Returns:
        The squared norm of the gradient outside the directions (scalar).
    """
    return (gradient_sq_norm - projections.square().sum()).clamp_min(0)


def complement_rayleigh_quotient(residual: Tensor, energy: Tensor) -> Tensor:
    """``q_⊥ = ‖Vᵀg_⊥‖² / ‖g_⊥‖²``: the batch GGN's curvature along ``g_⊥`` (or 0).

    Args:
        residual: ``Vᵀg_⊥`` (any shape).
        energy: ``‖g_⊥‖²`` (scalar).

    Returns:
        The Rayleigh quotient (scalar).
    """
    numerator = residual.square().sum()
    return torch.where(
        energy > 0, numerator / energy.clamp_min(torch.finfo(energy.dtype).tiny), 0.0
    )


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


def gram_projections(
    mean_products: Tensor, gram_evecs: Tensor, kept: Tensor, inverse_lengths: Tensor
) -> tuple[Tensor, Tensor]:
    """The gradient's projections on Gram directions and its residual ``Vᵀg_⊥``.

    A Gram eigenvector ``ũ_k`` gives the direction ``e_k = V ũ_k / ‖V ũ_k‖``, so
    ``ũ_kᵀ Vᵀḡ = ‖V ũ_k‖ ḡᵀe_k``.

    Args:
        mean_products: ``ḡᵀV`` ``[1, C·N]``.
        gram_evecs: ``ũ_k`` ``[C·N, K]``.
        kept: Whether the step keeps each direction ``[K]``.
        inverse_lengths: ``1 / ‖V ũ_k‖`` ``[K]``.

    Returns:
        ``p_k = ḡᵀe_k`` ``[K]`` (0 where not kept) and ``Vᵀg_⊥ = (I − ŨŨᵀ) Vᵀḡ``
        ``[1, C·N]``, the batch GGN's products with the complement's gradient.
    """
    in_directions = (mean_products @ gram_evecs).where(kept, 0.0)
    projections = in_directions.squeeze(0) * inverse_lengths
    return projections, mean_products - in_directions @ gram_evecs.T


def squared_norm(tensors: Sequence[Tensor]) -> Tensor:
    """``Σ ‖t‖²`` over the tensors, accumulated in float64 (0-dim)."""
    return cast(Tensor, sum(t.to(torch.float64).square().sum() for t in tensors))
