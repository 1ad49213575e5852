"""Selection of a finished block's directions: eigendecomposition and criterion."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.computations.block import Block
from dampednewton.math.cost import prefers_partial_eigensolver
from dampednewton.math.finite import all_finite
from dampednewton.math.gram_space import direction_lengths
from dampednewton.math.linalg import numerical_zero, symmetric_eigh, top_eigh
from dampednewton.math.precision import source_dtype, without_rounding
from dampednewton.policies.criteria import (
    Criterion,
    TopK,
    as_criterion,
    selected_indices,
    top_k_start,
)


@dataclass
class Directions:
    """Selected Gram-space eigenpairs of a GGN block.

    The parameter-space direction of ``ũ_k`` is ``e_k = V ũ_k / ‖V ũ_k‖``, normalised
    by its actual length (as ViViT does) rather than by ``√λ_k``: the two agree for
    numerically positive ``λ_k``, and only the first is defined for the others.

    Attributes:
        evals: Selected eigenvalues ``[K]``, ascending.
        gram_evecs: Matching Gram eigenvectors ``ũ_k`` ``[C·N, K]``.
        gram_images: ``Ĝ ũ_k`` ``[C·N, K]``.
        lengths: ``‖V ũ_k‖ = √(ũ_kᵀ Ĝ ũ_k)`` ``[K]`` (``0`` where ``V ũ_k``
            vanishes numerically).
        positive: ``[K]`` mask of the numerically positive eigenvalues (above the
            round-off level ``n·ε·λ_max``); steps give the others a zero coefficient.
        selected: ``[K]`` mask of the directions the criterion chose, a tail: with
            :class:`TopK` its positive ones (the fixed-size tail may hold more),
            with other criteria all.
    """

    evals: Tensor
    gram_evecs: Tensor
    gram_images: Tensor
    lengths: Tensor
    positive: Tensor
    selected: Tensor

    def last(self, count: int) -> Directions:
        """The last ``count`` directions (views).

        Args:
            count: How many, ``0 <= count <= K``.

        Returns:
            The directions ``K − count, …, K − 1``.
        """
        start = self.evals.numel() - count
        return Directions(
            evals=self.evals[start:],
            gram_evecs=self.gram_evecs[:, start:],
            gram_images=self.gram_images[:, start:],
            lengths=self.lengths[start:],
            positive=self.positive[start:],
            selected=self.selected[start:],
        )


def select_directions(block: Block, warn_small_eigvals: float) -> Directions:
    """Diagonalize a block's Gram matrix and apply its group's criterion, checked.

    The computations' entry point: it refuses a non-finite Gram matrix, selects
    exactly the criterion's directions and warns about small eigenvalues, which
    needs the host (see :func:`diagonalize` for the optimizer's version).

    Args:
        block: A block whose parameters were all reduced.
        warn_small_eigvals: Warn when a selected eigenvalue's magnitude is below.

    Returns:
        The selected eigenpairs.

    Raises:
        FloatingPointError: If the Gram matrix is not finite.
    """
    # Entries are bounded by the diagonal's (Cauchy-Schwarz): checking it suffices.
    if not all_finite(block.reduced_gram.diagonal()):
        raise FloatingPointError(
            "The GGN's Gram matrix is not finite (the model output or loss Hessian "
            "overflowed); no step can be computed."
        )
    criterion = as_criterion(block.group["criterion"])
    directions = diagonalize(
        block.reduced_gram, criterion, source_dtype(block.group["params"])
    )
    directions = directions.last(int(directions.selected.sum()))
    small = directions.evals[directions.positive].abs() < warn_small_eigvals
    if warn_small_eigvals > 0 and small.any():
        warnings.warn(
            f"Selected GGN eigenvalues are below warn_small_eigvals="
            f"{warn_small_eigvals}: their directions are normalised from V ũ of "
            "length ≈ √λ and may be inaccurate. "
            "Select fewer directions (e.g. EigenvalueThreshold) or set "
            "warn_small_eigvals=0 to silence this.",
            stacklevel=2,
        )
    return directions


def diagonalize(
    gram: Tensor, criterion: Criterion, source: torch.dtype | None = None
) -> Directions:
    """A finite Gram matrix's eigenpairs selected by a criterion, without checks.

    A :class:`TopK` criterion on a large Gram matrix uses the partial eigensolver
    :func:`top_eigh` (falling back to the full ``eigh`` if it does not converge).
    With :class:`TopK` the selection is the fixed-size tail of the ascending
    eigenvalues (:func:`top_k_start`) with its non-positive ones masked out of
    :attr:`Directions.positive`: no data-dependent shape, so no host sync besides
    the eigensolver's own. Other criteria return indices, read on the host.

    Criteria may select eigenvalues that are zero up to round-off or negative
    (ViViT's keep-all criterion ``lambda evals: list(range(evals.numel()))`` does):
    that warns, and such directions are marked in :attr:`Directions.positive`.

    Args:
        gram: Finite symmetric Gram matrix ``[C·N, C·N]``.
        criterion: The group's criterion.
        source: The dtype of the buffers the Gram matrix was formed from: for a
            half precision, eigenvalues at their rounding level count as zero
            (:func:`~dampednewton.math.precision.without_rounding`).

    Returns:
        The selected eigenpairs (with :class:`TopK`, possibly some that are not
        positive, marked).
    """
    evals, evecs = _eigenpairs(gram, criterion)
    if source is not None:
        evals = without_rounding(evals, source)
    start = top_k_start(criterion, evals.numel())
    if start is None:
        indices = selected_indices(criterion, evals)
        chosen, gram_evecs = evals[indices], evecs[:, indices]
    else:
        chosen, gram_evecs = evals[start:], evecs[:, start:]
    gram_images = gram @ gram_evecs
    positive = chosen > numerical_zero(evals)
    # The indices were read on the host already; TopK selects only positive ones.
    if start is None and not positive.all():
        # A constant text, so that Python's default filter reports it once.
        warnings.warn(
            "The criterion selected GGN eigenvalues that are zero up to round-off or "
            "negative (λ <= n·ε·λ_max): their eigenvectors are round-off normalised "
            "to unit length, not curvature directions, and damped Newton steps give "
            "them a zero coefficient. Select only positive eigenvalues (TopK, "
            "EigenvalueThreshold or RelativeThreshold) to avoid this.",
            stacklevel=3,
        )
    return Directions(
        evals=chosen,
        gram_evecs=gram_evecs,
        gram_images=gram_images,
        lengths=direction_lengths(gram_evecs, gram_images),
        positive=positive,
        selected=positive if start is not None else torch.ones_like(positive),
    )


def _eigenpairs(gram: Tensor, criterion: Criterion) -> tuple[Tensor, Tensor]:
    """All eigenpairs, or only the leading ones when a top-k criterion allows it."""
    if isinstance(criterion, TopK) and prefers_partial_eigensolver(
        gram.shape[0], criterion.k
    ):
        generator = torch.Generator().manual_seed(0)
        partial = top_eigh(gram, criterion.k, generator=generator)
        if partial is not None:
            return partial
    return symmetric_eigh(gram)
