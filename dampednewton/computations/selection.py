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
from dampednewton.math.linalg import symmetric_eigh, top_eigh
from dampednewton.policies.criteria import (
    TopK,
    as_criterion,
    numerical_zero,
    selected_indices,
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
    """

    evals: Tensor
    gram_evecs: Tensor
    gram_images: Tensor
    lengths: Tensor
    positive: Tensor


def select_directions(block: Block, warn_small_eigvals: float) -> Directions:
    """Diagonalize a block's Gram matrix and apply its group's criterion.

    A :class:`TopK` criterion on a large Gram matrix uses the partial eigensolver
    :func:`top_eigh` (falling back to the full ``eigh`` if it does not converge).
    Criteria may select eigenvalues that are zero up to round-off or negative (ViViT's
    keep-all criterion ``lambda evals: list(range(evals.numel()))`` does): that warns,
    and such directions are marked in :attr:`Directions.positive`.

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
    evals, evecs = _eigenpairs(block.reduced_gram, criterion)
    indices = selected_indices(criterion, evals)
    chosen = evals[indices]
    positive = chosen > numerical_zero(evals)
    # Constant texts, so that Python's default filter reports each once per place.
    if not positive.all():
        warnings.warn(
            "The criterion selected GGN eigenvalues that are zero up to round-off or "
            "negative (λ <= n·ε·λ_max): their eigenvectors are round-off normalised "
            "to unit length, not curvature directions, and damped Newton steps give "
            "them a zero coefficient. Select only positive eigenvalues (TopK, "
            "EigenvalueThreshold or RelativeThreshold) to avoid this.",
            stacklevel=2,
        )
    small = chosen[positive].abs() < warn_small_eigvals
    if warn_small_eigvals > 0 and small.any():
        warnings.warn(
            f"Selected GGN eigenvalues are below warn_small_eigvals="
            f"{warn_small_eigvals}: their directions are normalised from V ũ of "
            "length ≈ √λ and may be inaccurate. "
            "Select fewer directions (e.g. EigenvalueThreshold) or set "
            "warn_small_eigvals=0 to silence this.",
            stacklevel=2,
        )
    gram_evecs = evecs[:, indices]
    gram_images = block.reduced_gram @ gram_evecs
    return Directions(
        evals=chosen,
        gram_evecs=gram_evecs,
        gram_images=gram_images,
        lengths=direction_lengths(gram_evecs, gram_images),
        positive=positive,
    )


def _eigenpairs(gram: Tensor, criterion) -> tuple[Tensor, Tensor]:
    """All eigenpairs, or only the leading ones when a top-k criterion allows it."""
    if isinstance(criterion, TopK) and prefers_partial_eigensolver(
        gram.shape[0], criterion.k
    ):
        generator = torch.Generator().manual_seed(0)
        partial = top_eigh(gram, criterion.k, generator=generator)
        if partial is not None:
            return partial
    return symmetric_eigh(gram)
