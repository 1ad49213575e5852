"""Symmetric eigendecompositions and orthonormal bases, robust to ill-conditioning."""

from __future__ import annotations

import torch
from torch import Tensor

from dampednewton.math.finite import all_finite
from dampednewton.math.threads import small_matrix_threads

# Diagonal shifts tried, relative to the largest entry, when LAPACK fails to converge.
RETRY_SHIFTS = (0.0, 1e-12, 1e-8)


def numerical_zero(evals: Tensor) -> Tensor:
    """Round-off level of eigenvalues of an ``n×n`` symmetric matrix: ``n·ε·λ_max``.

    Args:
        evals: All eigenvalues of the matrix.

    Returns:
        The level below which an eigenvalue is zero up to round-off (``>= 0``), a
        0-dim tensor on the eigenvalues' device (no host sync).
    """
    if evals.numel() == 0:
        return evals.new_zeros(())
    eps = torch.finfo(evals.dtype).eps
    return evals.max().clamp(min=0) * (evals.numel() * eps)


def symmetric_eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of a symmetric matrix, robust to failures of ``eigh``.

    Low-precision ``eigh`` can fail to converge (or return non-finite values) on the
    rank-deficient Gram matrices of neural networks. The retry solves the problem in
    float64, scaled by a power of two (exact) to unit magnitude, and, should LAPACK
    still not converge, with a tiny diagonal shift that is subtracted again. The
    result is cast back to the input's dtype. Small CPU matrices are solved on a
    bounded number of threads (:func:`~dampednewton.math.threads.small_matrix_threads`).

    Args:
        matrix: Symmetric matrix of shape ``[M, M]``.

    Returns:
        Eigenvalues in ascending order (``[M]``) and orthonormal eigenvectors as the
        columns of an ``[M, M]`` matrix.

    Raises:
        torch.linalg.LinAlgError: If every attempt fails.
    """
    with small_matrix_threads(matrix):
        evals, evecs = _robust(matrix, torch.linalg.eigh)
    return evals, evecs


def symmetric_eigvalsh(matrix: Tensor) -> Tensor:
    """Eigenvalues of a symmetric matrix, with the retries of :func:`symmetric_eigh`.

    Args:
        matrix: Symmetric matrix of shape ``[M, M]``.

    Returns:
        Eigenvalues in ascending order, shape ``[M]``.

    Raises:
        torch.linalg.LinAlgError: If every attempt fails.
    """
    with small_matrix_threads(matrix):
        return _robust(matrix, lambda m: (torch.linalg.eigvalsh(m),))[0]


def _robust(matrix: Tensor, solve) -> tuple[Tensor, ...]:
    if matrix.dtype != torch.float64 and matrix.device.type == "cpu":
        # On the CPU the finiteness check waits for no device: try the cheaper
        # low-precision solve first. On a GPU it would cost a host sync besides the
        # eigensolver's own, so float64 is solved directly.
        try:
            result = solve(matrix)
            if all_finite(result[0]):
                return result
        except torch.linalg.LinAlgError:
            pass
    matrix64 = matrix.to(torch.float64)
    scale = power_of_two_scale(matrix64)
    normalized = matrix64 / scale
    identity = torch.eye(matrix.shape[0], dtype=torch.float64, device=matrix.device)
    for shift in RETRY_SHIFTS:
        try:
            evals, *rest = solve(normalized + shift * identity if shift else normalized)
        except torch.linalg.LinAlgError:
            continue
        evals = (evals - shift) * scale
        return (evals.to(matrix.dtype), *(r.to(matrix.dtype) for r in rest))
    largest = matrix64.abs().max().item() if matrix64.numel() else 0.0
    raise torch.linalg.LinAlgError(
        "The symmetric eigensolver did not converge on the Gram matrix, even in "
        f"float64 with diagonal shifts {RETRY_SHIFTS} (largest entry {largest:.3g})."
    )


def power_of_two_scale(matrix: Tensor) -> Tensor:
    """The least power of two above the largest entry's magnitude (1 for 0 or inf).

    Dividing by it is exact and brings the entries into ``(-1, 1)``, the largest to
    at least ``1/2``; it stays a tensor on the matrix's device (no host sync): 0-dim
    for a matrix, one scale per matrix (the leading shape) for matrices stacked as
    ``[..., m, n]``. With ``largest = m·2^e`` (``frexp``, ``m ∈ [1/2, 1)``) the scale
    ``largest / m = 2^e`` is exact; 0, inf and NaN give ``0/0``, ``inf/inf`` or NaN,
    replaced by 1 (five operators: the scale runs before every eigensolve).
    """
    if matrix.numel() == 0:
        return matrix.new_ones(matrix.shape[:-2])
    largest = matrix.abs().amax(dim=(-2, -1))
    mantissa, _ = torch.frexp(largest)
    return (largest / mantissa).nan_to_num(nan=1.0, posinf=1.0)


def top_eigh(
    matrix: Tensor,
    k: int,
    *,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
    max_blocks: int = 12,
    tolerance: float | None = None,
    stop_early: bool | None = None,
) -> tuple[Tensor, Tensor] | None:
    """Leading ``k`` eigenpairs of a symmetric PSD matrix by randomized block Krylov.

    Builds an orthonormal basis of ``span[AΩ, A²Ω, …]`` block by block (at most
    ``max_blocks``, as many as fit in ``n``) and solves the small Rayleigh-Ritz
    problem; the result is accepted once every wanted Ritz pair has a relative
    residual ``‖A u − θ u‖ / θ_max`` below ``tolerance``. Costs ``O(n²·b·q)`` instead
    of ``eigh``'s ``O(n³)``.

    Each convergence check is a host read. On the CPU it costs nothing, so the solver
    checks after every block and stops at the first converged one; on a GPU it would
    synchronize with the device every block, so the solver builds all blocks and
    checks once.

    Args:
        matrix: Symmetric positive semi-definite ``[n, n]`` matrix.
        k: Number of leading eigenpairs.
        generator: Source of the random start block.
        block_size: Columns per Krylov block (default ``k + 5``).
        max_blocks: Give up after this many blocks.
        tolerance: Relative residual to reach (default: 5e-4 in float32, 1e-10 in
            float64).
        stop_early: Check after every block (default: on the CPU only).

    Returns:
        ``(evals [k], evecs [n, k])`` ascending, or ``None`` if not converged (callers
        fall back to :func:`symmetric_eigh`).
    """
    if tolerance is None:
        tolerance = 1e-10 if matrix.dtype == torch.float64 else 5e-4
    if stop_early is None:
        stop_early = matrix.device.type == "cpu"
    size = matrix.shape[0]
    block_size = block_size or k + 5
    blocks = min(max_blocks, size // block_size)
    start = torch.randn(
        size, block_size, generator=generator, dtype=matrix.dtype, device="cpu"
    ).to(matrix.device)
    basis = torch.linalg.qr(matrix @ start).Q
    images = matrix @ basis
    for count in range(2, blocks + 1):
        new = images[:, -block_size:]
        for _ in range(2):  # re-orthogonalize twice for stability
            new = new - basis @ (basis.T @ new)
        new = torch.linalg.qr(new).Q
        basis = torch.cat([basis, new], dim=1)
        images = torch.cat([images, matrix @ new], dim=1)
        if stop_early or count == blocks:
            values, vectors, converged = _ritz_pairs(basis, images, k, tolerance)
            if bool(converged):
                return values, basis @ vectors
    return None


def _ritz_pairs(
    basis: Tensor, images: Tensor, k: int, tolerance: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The leading Ritz pairs in a basis (coordinates), and whether they converged."""
    projected = basis.T @ images
    ritz_values, ritz_vectors = symmetric_eigh((projected + projected.T) / 2)
    values, vectors = ritz_values[-k:], ritz_vectors[:, -k:]
    residuals = images @ vectors - (basis @ vectors) * values
    scale = ritz_values[-1].abs().clamp_min(torch.finfo(basis.dtype).tiny)
    return values, vectors, (residuals.norm(dim=0) / scale <= tolerance).all()


def cholesky_qr3(matrix: Tensor) -> Tensor:
    """The ``Q`` factors of stacked full-column-rank matrices ``[B, m, n]``.

    Shifted CholeskyQR3 (Fukaya et al., 2020): each pass takes ``Q ← Q·R⁻¹`` with
    ``RᵀR`` the Cholesky factorization of ``QᵀQ``; the first adds
    ``11(mn + n(n+1))·u·‖Q‖²_F`` to the diagonal so that it cannot break down, which
    leaves ``Q`` well enough conditioned for the two plain passes that follow (those
    of CholeskyQR2). As Householder's ``Q`` with a positive diagonal of ``R``: the
    first ``k`` columns span the matrix' first ``k``. Rows of zeros (padding) leave
    ``QᵀQ`` and the other rows alone and stay zero. Three batched products, Cholesky
    factorizations and triangular solves, without a host synchronization
    (``cholesky_ex``), where ``torch.linalg.qr`` on CUDA calls cuSOLVER per matrix
    (about 24 kernels each).

    Args:
        matrix: ``[B, m, n]``, each of full column rank with a condition number
            below ``1/u`` of its dtype (float64: about ``10¹⁵``).

    Returns:
        ``Q`` ``[B, m, n]``.
    """
    rows, columns = matrix.shape[-2:]
    unit = torch.finfo(matrix.dtype).eps / 2
    for step in range(3):
        gram = matrix.mT @ matrix
        if not step:
            diagonal = gram.diagonal(dim1=-2, dim2=-1)
            norms = diagonal.sum(-1, keepdim=True)  # ‖Q‖²_F
            diagonal.add_(
                11 * (rows * columns + columns * (columns + 1)) * unit * norms
            )
        lower = torch.linalg.cholesky_ex(gram).L
        matrix = torch.linalg.solve_triangular(lower.mT, matrix, upper=True, left=False)
    return matrix
