"""Eigendecomposition of a finished block and selection of its directions."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.computations.base import Block
from dampednewton.criteria import as_criterion, selected_indices
from dampednewton.linalg import symmetric_eigh


@dataclass
class Directions:
    """Selected Gram-space eigenpairs of a GGN block.

    Attributes:
        evals: Selected eigenvalues ``[K]``, ascending.
        gram_evecs: Matching Gram eigenvectors ``[C·N, K]``.
    """

    evals: Tensor
    gram_evecs: Tensor


def select_directions(block: Block, warn_small_eigvals: float) -> Directions:
    """Diagonalize a block's Gram matrix and apply its group's criterion.

    Args:
        block: A block whose parameters were all reduced.
        warn_small_eigvals: Warn when a selected eigenvalue's magnitude is below.

    Returns:
        The selected eigenpairs.
    """
    evals, evecs = symmetric_eigh(block.gram)
    indices = selected_indices(as_criterion(block.group["criterion"]), evals)
    chosen = evals[indices]
    if warn_small_eigvals > 0 and (chosen.abs() < warn_small_eigvals).any():
        warnings.warn(
            f"Selected GGN eigenvalues {chosen[chosen.abs() < warn_small_eigvals]} "
            f"are below warn_small_eigvals={warn_small_eigvals}: directions divide by "
            "√λ and may be inaccurate. Select fewer directions (e.g. "
            "EigenvalueThreshold) or set warn_small_eigvals=0 to silence this.",
            stacklevel=2,
        )
    return Directions(evals=chosen, gram_evecs=evecs[:, indices])


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
            mapped.append(factor.apply(gram_vectors))
    return mapped
