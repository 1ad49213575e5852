"""Eigendecomposition of a finished block and selection of its directions."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.computations.base import Block
from dampednewton.directional import direction_lengths
from dampednewton.finite import all_finite
from dampednewton.linalg import symmetric_eigh, top_eigh
from dampednewton.policies.criteria import (
    TopK,
    as_criterion,
    numerical_zero,
    selected_indices,
)

# The partial eigensolver pays off for large Gram matrices and few directions.
PARTIAL_MIN_SIZE = 512
PARTIAL_MAX_FRACTION = 1 / 16


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
    if not all_finite(block.gram.diagonal()):
        raise FloatingPointError(
            "The GGN's Gram matrix is not finite (the model output or loss Hessian "
            "overflowed); no step can be computed."
        )
    criterion = as_criterion(block.group["criterion"])
    evals, evecs = _eigenpairs(block.gram, criterion)
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
    gram_images = block.gram @ gram_evecs
    return Directions(
        evals=chosen,
        gram_evecs=gram_evecs,
        gram_images=gram_images,
        lengths=direction_lengths(gram_evecs, gram_images),
        positive=positive,
    )


def _eigenpairs(gram: Tensor, criterion) -> tuple[Tensor, Tensor]:
    """All eigenpairs, or only the leading ones when a top-k criterion allows it."""
    size = gram.shape[0]
    if (
        isinstance(criterion, TopK)
        and size >= PARTIAL_MIN_SIZE
        and criterion.k <= PARTIAL_MAX_FRACTION * size
    ):
        generator = torch.Generator().manual_seed(0)
        partial = top_eigh(gram, criterion.k, generator=generator)
        if partial is not None:
            return partial
    return symmetric_eigh(gram)


def to_parameter_space(block: Block, gram_vectors: Tensor) -> list[Tensor]:
    """Map Gram-space vectors ``[C·N(, K)]`` to each parameter of the block.

    Parameters that do not require gradients are outside the GGN block: they get
    zeros.

    Args:
        block: A finished block that kept its factors.
        gram_vectors: Vector ``[C·N]`` or matrix ``[C·N, K]``.

    Returns:
        One tensor per parameter, shaped ``p.shape`` (or ``[K, *p.shape]``).
    """
    leading = tuple(gram_vectors.shape[1:])
    shared: dict = {}  # a layer's weight and bias share work
    mapped = []
    for param in block.group["params"]:
        factor = block.factors.get(id(param))
        if factor is None:
            mapped.append(
                torch.zeros(
                    *leading, *param.shape, dtype=param.dtype, device=param.device
                )
            )
        else:
            mapped.append(factor.apply(gram_vectors, shared))
    return mapped
