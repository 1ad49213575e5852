r"""The averaged GGN as a rank-``r`` factor, and its update (pure tensor math).

The averaged GGN ``Ḡ_t = β Ḡ_{t−1} + (1−β) V Vᵀ`` is kept as ``B Bᵀ`` with the
``D×r`` factor ``B`` whose columns are ``√w_i u_i`` (``u_i`` orthonormal). Its update
with a new batch's square root ``V`` factors as ``M Mᵀ`` with
``M = [√β B, √(1−β) V]``, whose small Gram matrix is

.. math::

    M^\top M = \begin{pmatrix} \beta\,\mathrm{diag}(w) & \sqrt{\beta(1-\beta)}\,B^\top V
    \\ \cdot^\top & (1-\beta)\,V^\top V \end{pmatrix}.

Its top-``r`` eigenpairs ``(w', W)`` give ``B' = M W``: exact within ``span(M)``, and
nothing of size ``D×D`` is formed. The bias-corrected average is
``B Bᵀ / (1 − β^t)`` after ``t`` updates (as Adam's moments), so its eigenvalues are
``w_i / (1 − β^t)`` along ``u_i = B_i / √w_i``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dampednewton.math.linalg import numerical_zero, symmetric_eigh
from dampednewton.math.precision import without_rounding


def averaged_gram(
    basis_gram: Tensor, cross: Tensor, gram: Tensor, decay: float
) -> Tensor:
    """The Gram matrix ``MᵀM`` of ``M = [√β B, √(1−β) V]``.

    Args:
        basis_gram: ``BᵀB`` ``[r, r]`` (``diag(w)`` up to round-off: formed, not
            assumed, so that round-off does not accumulate over updates).
        cross: ``BᵀV`` ``[r, C·N]``.
        gram: ``VᵀV`` ``[C·N, C·N]``.
        decay: ``β``.

    Returns:
        ``[r + C·N, r + C·N]`` symmetric matrix.
    """
    mixed = math.sqrt(decay * (1 - decay)) * cross
    top = torch.cat([decay * basis_gram, mixed], dim=1)
    bottom = torch.cat([mixed.T, (1 - decay) * gram], dim=1)
    return torch.cat([top, bottom], dim=0)


def leading_eigenpairs(
    matrix: Tensor, rank: int, source: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The ``rank`` largest eigenpairs, ascending, those not positive zeroed.

    Fixed-size (``min(rank, m)`` pairs, so no host sync): eigenvalues that are not
    numerically positive become ``0`` and their eigenvectors zero columns, which
    add nothing to ``W diag(w) Wᵀ``. They come first (ascending order).

    Args:
        matrix: Symmetric PSD matrix ``[m, m]``.
        rank: Maximum number of eigenpairs.
        source: The dtype of the batch's buffers in ``matrix`` (a half precision:
            eigenvalues at their rounding level count as zero,
            :func:`~dampednewton.math.precision.without_rounding`).

    Returns:
        Eigenvalues ``[r']`` and eigenvectors ``[m, r']`` with ``r' = min(rank, m)``.
    """
    evals, evecs = symmetric_eigh(matrix)
    if source is not None:
        evals = without_rounding(evals, source)
    first = max(evals.numel() - rank, 0)
    keep = evals[first:] > numerical_zero(evals)
    return evals[first:].where(keep, 0.0), evecs[:, first:] * keep


def split_mixing(mixing: Tensor, rank: int, decay: float) -> tuple[Tensor, Tensor]:
    """Split ``W`` into the multipliers of ``B`` and ``V`` in ``B' = M W``.

    Args:
        mixing: ``W`` ``[r + C·N, r']``.
        rank: ``r``, the current number of columns of ``B``.
        decay: ``β``.

    Returns:
        ``√β W_B`` ``[r, r']`` and ``√(1−β) W_V`` ``[C·N, r']``.
    """
    return math.sqrt(decay) * mixing[:rank], math.sqrt(1 - decay) * mixing[rank:]


def bias_corrected(weights: Tensor, decay: float, updates: int) -> Tensor:
    """Eigenvalues ``w / (1 − β^t)`` of the bias-corrected average.

    Args:
        weights: ``w`` ``[r]``.
        decay: ``β``.
        updates: ``t >= 1``.

    Returns:
        ``[r]`` eigenvalues.
    """
    return weights / (1 - decay**updates)


def rotated_basis(
    previous: Sequence[Tensor], mapped: Sequence[Tensor], of_basis: Tensor
) -> tuple[Tensor, ...]:
    """``B' = √β B W_B + √(1−β) V W_V`` per parameter, from its two parts.

    Args:
        previous: ``B`` per parameter, ``[r, *shape]`` each.
        mapped: ``√(1−β) V W_V`` per parameter, ``[r', *shape]`` each (written to).
        of_basis: ``√β W_B`` ``[r, r']`` (:func:`split_mixing`).

    Returns:
        ``B'`` per parameter, ``[r', *shape]`` each (``mapped``, updated in place).
    """
    return tuple(
        new.flatten(1).addmm_(of_basis.T.to(old), old.flatten(1)).view_as(new)
        for old, new in zip(previous, mapped, strict=True)
    )
