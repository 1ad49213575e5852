"""Directional derivatives and damped Newton coefficients in Gram space.

Notation (as in ViViT, Dangel et al. 2022): ``Ĝ = VᵀV`` is the ``[C·N, C·N]`` Gram
matrix of a GGN block built from ``N`` samples, ``Ĝ ũ_k = λ_k ũ_k``, and the
parameter-space eigenvector is ``e_k = V ũ_k / ‖V ũ_k‖`` with
``‖V ũ_k‖² = ũ_kᵀ Ĝ ũ_k`` (``= λ_k`` in exact arithmetic). Normalising by the actual
length, as ViViT's eigenvectors are, keeps ``e_k`` a unit vector for eigenvalues that
are zero up to round-off or negative, where ``√λ_k`` is meaningless. A direction whose
``V ũ_k`` vanishes numerically (``ũ_kᵀ Ĝ ũ_k <= 0``) is the zero vector: its
derivatives and coefficients are zero.
"""

from __future__ import annotations

import torch
from torch import Tensor


def direction_lengths(gram_evecs: Tensor, gram_images: Tensor) -> Tensor:
    """Lengths ``‖V ũ_k‖ = √(ũ_kᵀ Ĝ ũ_k)`` of the unnormalised directions.

    Args:
        gram_evecs: Selected Gram eigenvectors ``ũ_k`` ``[C·N, K]``.
        gram_images: ``Ĝ ũ_k`` ``[C·N, K]``.

    Returns:
        ``[K]`` lengths, ``0`` where the quadratic form is not positive.
    """
    return (gram_evecs * gram_images).sum(0).clamp_min(0).sqrt()


def inverse_lengths(lengths: Tensor) -> Tensor:
    """``1 / ‖V ũ_k‖``, and ``0`` for directions of length zero (no NaN, no ∞).

    Args:
        lengths: ``[K]`` lengths from :func:`direction_lengths`.

    Returns:
        ``[K]`` factors that normalise ``V ũ_k``.
    """
    return torch.where(lengths > 0, lengths.reciprocal(), 0.0)


def directional_gradients(
    gradient_products: Tensor, gram_evecs: Tensor, lengths: Tensor
) -> Tensor:
    """First-order directional derivatives ``γ_nk = gₙᵀ e_k``.

    Args:
        gradient_products: ``[N', C·N]`` products ``gₙᵀ V`` of each gradient with ``V``.
        gram_evecs: Selected Gram eigenvectors ``[C·N, K]``.
        lengths: ``‖V ũ_k‖`` ``[K]`` (:func:`direction_lengths`).

    Returns:
        ``[N', K]`` directional gradients.
    """
    return (gradient_products @ gram_evecs) * inverse_lengths(lengths)


def directional_curvatures(
    gram_images: Tensor, lengths: Tensor, num_outputs: int, num_samples: int
) -> Tensor:
    """Per-sample second-order directional derivatives ``λ_nk = e_kᵀ Gₙ e_k``.

    With ``V``'s columns ``N^{-1/2} Jₙᵀ Sₙ[:, c]``, ``Gₙ = N Vₙ Vₙᵀ`` and ``Vₙᵀ V ũ_k``
    are the rows ``c·N + n`` of ``Ĝ ũ_k``, so
    ``λ_nk = N Σ_c (Ĝ ũ_k)[c·N + n]² / ‖V ũ_k‖²`` needs no further backward pass
    (``N λ_k Σ_c ũ_k[c·N + n]²`` for an exact eigenpair). Their mean over the ``N``
    samples is the Rayleigh quotient ``e_kᵀ Ĝ e_k``, i.e. ``λ_k``.

    Args:
        gram_images: ``Ĝ ũ_k`` ``[C·N, K]`` of the selected Gram eigenvectors.
        lengths: ``‖V ũ_k‖`` ``[K]`` (:func:`direction_lengths`).
        num_outputs: ``C``, the number of square-root columns per sample.
        num_samples: ``N``, the number of samples that built the Gram matrix.

    Returns:
        ``[N, K]`` directional curvatures.
    """
    squared = gram_images.reshape(num_outputs, num_samples, -1).square().sum(0)
    return num_samples * squared * inverse_lengths(lengths).square()


def newton_coefficients(
    gamma_mean: Tensor, lambda_mean: Tensor, damping: Tensor
) -> Tensor:
    """Step lengths ``c_k = −γ̄_k / (λ̄_k + δ_k)`` along each direction.

    Args:
        gamma_mean: Mean directional gradients ``[K]``.
        lambda_mean: Mean directional curvatures ``[K]``.
        damping: Directional damping ``[K]``.

    Returns:
        ``[K]`` Newton coefficients.
    """
    return -gamma_mean / (lambda_mean + damping)


def gram_space_step(
    coefficients: Tensor, gram_evecs: Tensor, lengths: Tensor
) -> Tensor:
    """Gram-space vector ``β = Σ_k c_k ũ_k / ‖V ũ_k‖``, so that the step is ``s = V β``.

    Args:
        coefficients: Newton coefficients ``[K]``.
        gram_evecs: Selected Gram eigenvectors ``[C·N, K]``.
        lengths: ``‖V ũ_k‖`` ``[K]`` (:func:`direction_lengths`).

    Returns:
        ``[C·N]`` vector.
    """
    return gram_evecs @ (coefficients * inverse_lengths(lengths))
