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
            if torch.isfinite(evals).all():
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


def top_eigh(
    matrix: Tensor,
    k: int,
    *,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
    max_blocks: int = 12,
    tolerance: float | None = None,
) -> tuple[Tensor, Tensor] | None:
    """Leading ``k`` eigenpairs of a symmetric PSD matrix by randomized block Krylov.

    Builds an orthonormal basis of ``span[AΩ, A²Ω, …]`` block by block and solves the
    small Rayleigh-Ritz problem; stops once every wanted Ritz pair has a relative
    residual ``‖A u − θ u‖ / θ_max`` below ``tolerance``. Costs ``O(n²·b·q)`` instead
    of ``eigh``'s ``O(n³)``.

    Args:
        matrix: Symmetric positive semi-definite ``[n, n]`` matrix.
        k: Number of leading eigenpairs.
        generator: Source of the random start block.
        block_size: Columns per Krylov block (default ``k + 5``).
        max_blocks: Give up after this many blocks.
        tolerance: Relative residual to reach (default: 5e-4 in float32, 1e-10 in
            float64).

    Returns:
        ``(evals [k], evecs [n, k])`` ascending, or ``None`` if not converged (callers
        fall back to :func:`symmetric_eigh`).
    """
    if tolerance is None:
        tolerance = 1e-10 if matrix.dtype == torch.float64 else 5e-4
    size = matrix.shape[0]
    block_size = block_size or k + 5
    start = torch.randn(
        size, block_size, generator=generator, dtype=matrix.dtype, device="cpu"
    ).to(matrix.device)
    basis = torch.linalg.qr(matrix @ start).Q
    images = matrix @ basis
    for _ in range(max_blocks - 1):
        if basis.shape[1] + block_size > size:
            return None
        new = images[:, -block_size:]
        for _ in range(2):  # re-orthogonalize twice for stability
            new = new - basis @ (basis.T @ new)
        new = torch.linalg.qr(new).Q
        basis = torch.cat([basis, new], dim=1)
        images = torch.cat([images, matrix @ new], dim=1)
        projected = basis.T @ images
        ritz_values, ritz_vectors = torch.linalg.eigh((projected + projected.T) / 2)
        values, vectors = ritz_values[-k:], ritz_vectors[:, -k:]
        residuals = images @ vectors - (basis @ vectors) * values
        scale = ritz_values[-1].abs().clamp_min(torch.finfo(matrix.dtype).tiny)
        if (residuals.norm(dim=0) / scale <= tolerance).all():
            return values, basis @ vectors
    return None
