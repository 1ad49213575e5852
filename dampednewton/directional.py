"""Directional derivatives and damped Newton coefficients in Gram space.

Notation (see the design notes): ``Ĝ = VᵀV`` is the ``[C·N, C·N]`` Gram matrix of a GGN
block built from ``N`` samples, ``Ĝ ũ_k = λ_k ũ_k``, and the parameter-space
eigenvector is ``e_k = V ũ_k / √λ_k``.
"""

from __future__ import annotations

from torch import Tensor


def directional_gradients(
    gradient_products: Tensor, gram_evecs: Tensor, evals: Tensor
) -> Tensor:
    """First-order directional derivatives ``γ_nk = gₙᵀ e_k``.

    Args:
        gradient_products: ``[N', C·N]`` products ``gₙᵀ V`` of each gradient with ``V``.
        gram_evecs: Selected Gram eigenvectors ``[C·N, K]``.
        evals: Their eigenvalues ``[K]`` (strictly positive).

    Returns:
        ``[N', K]`` directional gradients.
    """
    return (gradient_products @ gram_evecs) / evals.sqrt()


def directional_curvatures(
    gram_evecs: Tensor, evals: Tensor, num_outputs: int, num_samples: int
) -> Tensor:
    """Per-sample second-order directional derivatives ``λ_nk = e_kᵀ Gₙ e_k``.

    With ``V``'s columns ``N^{-1/2} Jₙᵀ Sₙ[:, c]`` one has
    ``λ_nk = N λ_k Σ_c ũ_k[c·N + n]²``, so no further backward pass is needed. Their
    mean over the ``N`` samples is ``λ_k``.

    Args:
        gram_evecs: Selected Gram eigenvectors ``[C·N, K]``.
        evals: Their eigenvalues ``[K]``.
        num_outputs: ``C``, the number of square-root columns per sample.
        num_samples: ``N``, the number of samples that built the Gram matrix.

    Returns:
        ``[N, K]`` directional curvatures.
    """
    squared = gram_evecs.reshape(num_outputs, num_samples, -1).square().sum(0)
    return num_samples * evals * squared


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


def gram_space_step(coefficients: Tensor, gram_evecs: Tensor, evals: Tensor) -> Tensor:
    """Gram-space vector ``β = Σ_k c_k ũ_k / √λ_k``, so that the step is ``s = V β``.

    Args:
        coefficients: Newton coefficients ``[K]``.
        gram_evecs: Selected Gram eigenvectors ``[C·N, K]``.
        evals: Their eigenvalues ``[K]``.

    Returns:
        ``[C·N]`` vector.
    """
    return gram_evecs @ (coefficients / evals.sqrt())
