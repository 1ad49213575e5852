"""Brute-force directional derivatives and the directionally damped Newton step."""

from __future__ import annotations

import torch
from torch import Tensor

from tests.reference.ggn import ggn_eigenpairs


def directional_derivatives(
    G_sub: Tensor, Gn: Tensor, grads: Tensor, k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """First/second-order directional derivatives along the top-k GGN eigenvectors.

    Directions ``e_j`` are the eigenvectors of the ``k`` largest eigenvalues of
    ``G_sub``, kept in ascending order (the last ``k`` columns of ``eigh``).
    Eigenvectors are defined up to sign (γ flips with it, λ does not), and only up
    to rotation within repeated eigenvalues.

    Args:
        G_sub: GGN of the curvature samples, shape ``[D, D]``.
        Gn: Per-sample GGNs, shape ``[N_ggn, D, D]``. If they are the GGNs of the
            samples that built ``G_sub``, ``lambdas.mean(0) == evals``.
        grads: Per-sample gradients ``∇ℓ_n`` (not divided by N), shape
            ``[N_grad, D]``.
        k: Number of directions, ``1 ≤ k ≤ D``.

    Returns:
        ``(gammas, lambdas, evals, evecs)`` with ``gammas [N_grad, k]``
        (``gammas[n, j] = grads[n] · e_j``), ``lambdas [N_ggn, k]``
        (``lambdas[n, j] = e_jᵀ Gn[n] e_j``), ``evals [k]`` and ``evecs [D, k]``.

    Raises:
        ValueError: If shapes are inconsistent or ``k`` is out of range.
    """
    dim = G_sub.shape[0]
    if Gn.dim() != 3 or Gn.shape[1:] != (dim, dim):
        raise ValueError(
            f"Gn must have shape [N, {dim}, {dim}], got {tuple(Gn.shape)}."
        )
    if grads.dim() != 2 or grads.shape[1] != dim:
        raise ValueError(f"grads must have shape [N, {dim}], got {tuple(grads.shape)}.")
    if not 1 <= k <= dim:
        raise ValueError(f"k must lie in [1, {dim}], got {k}.")
    evals, evecs = ggn_eigenpairs(G_sub)
    evals, evecs = evals[-k:], evecs[:, -k:]
    gammas = grads @ evecs
    lambdas = torch.einsum("dj,nde,ej->nj", evecs, Gn, evecs)
    return gammas, lambdas, evals, evecs


def damped_newton_step(
    G_sub: Tensor, Gn: Tensor, grads: Tensor, k: int, damping: Tensor
) -> Tensor:
    """Directionally damped Newton step ``Σ_j −mean_n(γ_nj)/(mean_n(λ_nj)+δ_j) e_j``.

    With ``k = D`` and constant damping δ, and ``Gn`` the GGNs of the samples of
    ``G_sub``, this is ``−(G_sub + δI)⁻¹ ḡ``.

    Args:
        G_sub: GGN of the curvature samples, shape ``[D, D]``.
        Gn: Per-sample GGNs of the curvature samples, shape ``[N_ggn, D, D]``.
        grads: Per-sample gradients of the gradient samples, shape ``[N_grad, D]``.
        k: Number of top eigen-directions, ``1 ≤ k ≤ D``.
        damping: Damping δ per direction, shape ``[k]``, in the ascending order of
            the directions.

    Returns:
        Step of shape ``[D]``.

    Raises:
        ValueError: If ``damping`` has the wrong shape or a denominator vanishes.
    """
    gammas, lambdas, _, evecs = directional_derivatives(G_sub, Gn, grads, k)
    if damping.shape != (k,):
        raise ValueError(f"damping must have shape [{k}], got {tuple(damping.shape)}.")
    denominators = lambdas.mean(0) + damping
    if (denominators == 0).any():
        raise ValueError(
            "A direction has zero curvature plus damping; add damping or select "
            "fewer directions."
        )
    return evecs @ (-gammas.mean(0) / denominators)
