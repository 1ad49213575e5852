"""Brute-force GGN blocks, their diagonal, eigenpairs and the Gram/GGN spectra."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from tests.reference.derivatives import loss_hessians, output_jacobians
from tests.reference.validation import (
    check_ascending,
    check_subsampling,
    check_symmetric,
)


def per_sample_ggns(
    model: nn.Module,
    loss_fn: nn.Module,
    params: Sequence[Tensor],
    X: Tensor,
    y: Tensor,
) -> Tensor:
    """Per-sample GGNs ``G_n = J_nᵀ H_n J_n`` of a parameter group.

    Args:
        model: Model mapping ``X`` to outputs of shape ``[N, C]``.
        loss_fn: Loss module with ``reduction="mean"``.
        params: Parameter group.
        X: Inputs, leading dimension ``N``.
        y: Targets, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N, D, D]``.
    """
    jacobians = output_jacobians(model, params, X)
    with torch.no_grad():
        hessians = loss_hessians(loss_fn, model(X), y)
    return torch.einsum("ncd,nce,nef->ndf", jacobians, hessians, jacobians)


def ggn(
    model: nn.Module,
    loss_fn: nn.Module,
    params: Sequence[Tensor],
    X: Tensor,
    y: Tensor,
    subsampling: list[int] | None = None,
) -> Tensor:
    """GGN block ``G_S = (1/|S|) Σ_{n∈S} G_n`` of a parameter group.

    Args:
        model: Model mapping ``X`` to outputs of shape ``[N, C]``.
        loss_fn: Loss module with ``reduction="mean"``.
        params: Parameter group.
        X: Inputs, leading dimension ``N``.
        y: Targets, leading dimension ``N``.
        subsampling: Sample indices ``S`` (repeated indices count repeatedly);
            ``None`` uses all samples.

    Returns:
        Tensor of shape ``[D, D]``.
    """
    indices = check_subsampling(subsampling, X.shape[0])
    return per_sample_ggns(model, loss_fn, params, X, y)[indices].mean(0)


def ggn_diagonal(
    model: nn.Module, loss_fn: nn.Module, params: list[Tensor], X: Tensor, y: Tensor
) -> Tensor:
    """Diagonal of the GGN ``(1/N) Σ_n J_nᵀ H_n J_n`` from explicit Jacobians.

    Returns:
        Vector over the concatenated ``params``.
    """
    return torch.diagonal(ggn(model, loss_fn, params, X, y))


def ggn_eigenpairs(G: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of a symmetric GGN block.

    Args:
        G: Symmetric matrix of shape ``[D, D]``.

    Returns:
        Eigenvalues ``[D]`` in ascending order and orthonormal eigenvectors
        ``[D, D]`` as columns (``G @ evecs[:, k] = evals[k] * evecs[:, k]``).
    """
    check_symmetric(G, "G")
    return torch.linalg.eigh(G)


def match_spectra(gram_evals: Tensor, ggn_evals: Tensor) -> tuple[Tensor, Tensor]:
    """Comparable parts of the Gram and the GGN spectrum.

    ``Ĝ = VᵀV`` ((N·C)×(N·C)) and ``G = VVᵀ`` (D×D) share their non-zero
    eigenvalues; the remaining ones are zero. Hence the largest ``min(D, N·C)``
    eigenvalues of both agree; the others are checked with ``extra_eigenvalues``.

    Args:
        gram_evals: Gram eigenvalues, ascending, shape ``[N·C]``.
        ggn_evals: GGN eigenvalues, ascending, shape ``[D]``.

    Returns:
        The largest ``min(D, N·C)`` eigenvalues of each, ascending.
    """
    common = min(check_ascending(gram_evals), check_ascending(ggn_evals))
    return gram_evals[-common:], ggn_evals[-common:]


def extra_eigenvalues(gram_evals: Tensor, ggn_evals: Tensor) -> Tensor:
    """Eigenvalues of the longer spectrum that ``match_spectra`` leaves out.

    These are the smallest ``|N·C − D|`` eigenvalues of the Gram matrix (if
    ``N·C > D``) or of the GGN (if ``D > N·C``); all of them must be zero up to
    round-off.

    Args:
        gram_evals: Gram eigenvalues, ascending, shape ``[N·C]``.
        ggn_evals: GGN eigenvalues, ascending, shape ``[D]``.

    Returns:
        The left-out eigenvalues (possibly empty), ascending.
    """
    num_gram, num_ggn = check_ascending(gram_evals), check_ascending(ggn_evals)
    longer = gram_evals if num_gram >= num_ggn else ggn_evals
    return longer[: abs(num_gram - num_ggn)]
