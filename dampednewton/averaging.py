r"""Curvature averaged across steps as a rank-``r`` factor (pure tensor math).

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
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.math.linalg import symmetric_eigh
from dampednewton.policies.criteria import Criterion, TopK, numerical_zero

DEFAULT_RANK = 20
"""Rank of the averaged factor for criteria other than top-k."""


@dataclass(frozen=True)
class CurvatureAveraging:
    """Average the GGN across steps as a rank-``rank`` factor.

    Attributes:
        decay: ``β`` in ``[0, 1)``: the weight of the past at each refresh (``0``:
            the refreshing batch only).
        rank: Columns ``r`` of the factor ``B`` (the criterion then picks among its
            ``r`` eigen-directions); ``None``: the ``k`` of a :class:`TopK` criterion,
            else 20.
        interval: Refresh the factor every ``interval`` steps. The steps in
            between keep its basis, damping and complement curvature and take the
            step along it with the new mean gradient only
            (:mod:`dampednewton.math.frozen_basis`), after a backward pass with
            BackPACK's hooks suspended: about the cost of an Adam step.
        ramp: Start with frequent refreshes while the curvature changes fast: the
            gaps between refreshes double from 1 (steps 0, 1, 3, 7, …) until they
            reach ``interval``.
        loss_tolerance: Refresh at the next step when a step between refreshes
            sees a mini-batch loss above ``1 + loss_tolerance`` times the loss of
            the last refresh (the frozen curvature no longer describes the model);
            ``None`` only follows the schedule.
    """

    decay: float = 0.6
    rank: int | None = None
    interval: int = 20
    ramp: bool = True
    loss_tolerance: float | None = 1.0

    def __post_init__(self) -> None:
        """Validate the settings."""
        if not isinstance(self.decay, int | float) or not 0 <= self.decay < 1:
            raise ValueError(
                f"CurvatureAveraging needs 0 <= decay < 1, got {self.decay!r}."
            )
        tolerance = self.loss_tolerance
        if tolerance is not None and (
            isinstance(tolerance, bool)
            or not isinstance(tolerance, int | float)
            or not tolerance >= 0
        ):
            raise ValueError(
                "CurvatureAveraging needs loss_tolerance >= 0 or None, got "
                f"{tolerance!r}."
            )
        if not isinstance(self.ramp, bool):
            raise TypeError(f"CurvatureAveraging needs a bool ramp, got {self.ramp!r}.")
        for name in ("rank", "interval"):
            value = getattr(self, name)
            if name == "rank" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"CurvatureAveraging needs an integer {name} >= 1, got {value!r}."
                )
            if value < 1:
                raise ValueError(
                    f"CurvatureAveraging needs an integer {name} >= 1, got {value!r}."
                )

    def rank_for(self, criterion: Criterion) -> int:
        """The factor's rank: ``rank``, or the ``k`` of a top-``k`` criterion.

        Args:
            criterion: The group's criterion.

        Returns:
            The number of columns to keep.
        """
        if self.rank is not None:
            return self.rank
        return criterion.k if isinstance(criterion, TopK) else DEFAULT_RANK

    def refreshes(self, step: int, updates: int) -> bool:
        """Whether step ``step`` (from 0) refreshes a factor of ``updates`` batches.

        Args:
            step: The optimizer's step index.
            updates: Batches averaged into the factor so far.

        Returns:
            ``True`` for the first factor and on the schedule's refresh steps.
        """
        if updates == 0:
            return True
        if not self.ramp:
            return step % self.interval == 0
        # Gaps 1, 2, 4, … below the interval end at step 2^m − 1, the first with
        # 2^m ≥ interval; from there every interval steps.
        end_of_ramp = (1 << (self.interval - 1).bit_length()) - 1
        if step <= end_of_ramp:
            return (step + 1) & step == 0
        return (step - end_of_ramp) % self.interval == 0


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


def leading_eigenpairs(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """The ``rank`` largest eigenpairs, ascending, those not positive zeroed.

    Fixed-size (``min(rank, m)`` pairs, so no host sync): eigenvalues that are not
    numerically positive become ``0`` and their eigenvectors zero columns, which
    add nothing to ``W diag(w) Wᵀ``. They come first (ascending order).

    Args:
        matrix: Symmetric PSD matrix ``[m, m]``.
        rank: Maximum number of eigenpairs.

    Returns:
        Eigenvalues ``[r']`` and eigenvectors ``[m, r']`` with ``r' = min(rank, m)``.
    """
    evals, evecs = symmetric_eigh(matrix)
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


# Policies live in param groups: let `torch.load(weights_only=True)` restore them.
torch.serialization.add_safe_globals([CurvatureAveraging])
