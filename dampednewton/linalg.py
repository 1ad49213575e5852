"""Symmetric eigendecompositions of Gram matrices, robust to ill-conditioning."""

from __future__ import annotations

import torch
from torch import Tensor


def symmetric_eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of a symmetric matrix, retried in float64 when it fails.

    Low-precision ``eigh`` can fail to converge (or return non-finite values) on the
    rank-deficient Gram matrices of neural networks. The retry solves the problem in
    float64 and casts the result back to the input's dtype.

    Args:
        matrix: Symmetric matrix of shape ``[M, M]``.

    Returns:
        Eigenvalues in ascending order (``[M]``) and orthonormal eigenvectors as the
        columns of an ``[M, M]`` matrix.
    """
    if matrix.dtype != torch.float64:
        try:
            evals, evecs = torch.linalg.eigh(matrix)
            if torch.isfinite(evals).all() and torch.isfinite(evecs).all():
                return evals, evecs
        except torch.linalg.LinAlgError:
            pass
    evals, evecs = torch.linalg.eigh(matrix.to(torch.float64))
    return evals.to(matrix.dtype), evecs.to(matrix.dtype)


def symmetric_eigvalsh(matrix: Tensor) -> Tensor:
    """Eigenvalues of a symmetric matrix, retried in float64 when they fail.

    Args:
        matrix: Symmetric matrix of shape ``[M, M]``.

    Returns:
        Eigenvalues in ascending order, shape ``[M]``.
    """
    if matrix.dtype != torch.float64:
        try:
            evals = torch.linalg.eigvalsh(matrix)
            if torch.isfinite(evals).all():
                return evals
        except torch.linalg.LinAlgError:
            pass
    return torch.linalg.eigvalsh(matrix.to(torch.float64)).to(matrix.dtype)
