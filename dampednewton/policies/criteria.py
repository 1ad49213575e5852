"""Criteria: which GGN eigen-directions a step uses.

A criterion receives a block's Gram eigenvalues in ascending order and returns the
indices of the selected ones (ViViT's convention). The built-in policies only select
numerically positive eigenvalues, above the round-off level ``n·ε·λ_max`` of a
symmetric eigensolver on an ``n×n`` Gram matrix: the directions of eigenvalues that are
zero up to round-off are round-off themselves. Callables may select those too (ViViT's
keep-all ``lambda evals: list(range(evals.numel()))``): the computations then warn,
and steps give such directions a zero coefficient.

Adding a criterion: a frozen dataclass here, listed in ``add_safe_globals`` at the
bottom (and among the trusted ones in :func:`selected_indices` if its answer is
sorted, unique and in range by construction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from dampednewton.math.linalg import numerical_zero
from dampednewton.policies.checks import check_number


@runtime_checkable
class Criterion(Protocol):
    """Maps a block's ascending Gram eigenvalues to the indices of those to use."""

    def __call__(self, evals: Tensor) -> Sequence[int]:
        """Return the selected indices into ``evals``."""


def top_k_start(criterion: Criterion, num_evals: int) -> int | None:
    """Where a fixed-size tail of ascending eigenvalues holds the criterion's choice.

    A :class:`TopK` criterion selects the last ``k`` eigenvalues, less those that are
    not numerically positive. Taking the tail ``evals[start:]`` with a mask of the
    positive ones gives the same step without a data-dependent shape, so without a
    host sync.

    Args:
        criterion: The group's criterion.
        num_evals: Number of eigenvalues.

    Returns:
        ``max(num_evals − k, 0)`` for :class:`TopK`, ``None`` for other criteria.
    """
    if not isinstance(criterion, TopK):
        return None
    return max(num_evals - criterion.k, 0)


def _positive_indices(evals: Tensor) -> Tensor:
    return torch.nonzero(evals > numerical_zero(evals)).flatten()


@dataclass(frozen=True)
class TopK:
    """Select the ``k`` largest numerically positive eigenvalues.

    Attributes:
        k: Number of directions (at least 1). Fewer are selected when fewer
            eigenvalues are positive.
    """

    k: int

    def __post_init__(self) -> None:
        """Validate ``k``."""
        if isinstance(self.k, bool) or not isinstance(self.k, int):
            raise TypeError(f"TopK needs an integer k >= 1, got {self.k!r}.")
        if self.k < 1:
            raise ValueError(f"TopK needs an integer k >= 1, got {self.k!r}.")

    def __call__(self, evals: Tensor) -> list[int]:
        """Return the indices of the selected eigenvalues (ascending)."""
        positive = _positive_indices(evals)
        return positive[-self.k :].tolist()


@dataclass(frozen=True)
class EigenvalueThreshold:
    """Select every eigenvalue strictly above ``min_value`` (and above round-off).

    Attributes:
        min_value: Threshold (non-negative), e.g. ``1e-4`` to skip directions whose
            eigenvector computation divides by a tiny ``√λ``.
    """

    min_value: float

    def __post_init__(self) -> None:
        """Validate the threshold."""
        check_number("EigenvalueThreshold's min_value", self.min_value)
        if not math.isfinite(self.min_value) or self.min_value < 0:
            raise ValueError(
                f"EigenvalueThreshold needs a finite min_value >= 0, got "
                f"{self.min_value!r}."
            )

    def __call__(self, evals: Tensor) -> list[int]:
        """Return the indices of the selected eigenvalues (ascending)."""
        keep = (evals > self.min_value) & (evals > numerical_zero(evals))
        return torch.nonzero(keep).flatten().tolist()


@dataclass(frozen=True)
class RelativeThreshold:
    """Select eigenvalues of at least ``fraction`` times the largest one.

    Attributes:
        fraction: In ``(0, 1]``; ``1`` keeps only the leading direction (and ties).
    """

    fraction: float

    def __post_init__(self) -> None:
        """Validate the fraction."""
        check_number("RelativeThreshold's fraction", self.fraction)
        if not 0 < self.fraction <= 1:
            raise ValueError(
                f"RelativeThreshold needs 0 < fraction <= 1, got {self.fraction!r}."
            )

    def __call__(self, evals: Tensor) -> list[int]:
        """Return the indices of the selected eigenvalues (ascending)."""
        if evals.numel() == 0 or evals.max() <= 0:
            return []
        keep = (evals >= self.fraction * evals.max()) & (evals > numerical_zero(evals))
        return torch.nonzero(keep).flatten().tolist()


def as_criterion(criterion: int | Criterion) -> Criterion:
    """Turn the shorthand ``int k`` into :class:`TopK`; pass callables through.

    Args:
        criterion: An integer ``k >= 1`` or a callable ``evals -> indices``.

    Returns:
        A callable criterion.

    Raises:
        ValueError: For an integer below 1.
        TypeError: For anything that is neither an integer nor callable.
    """
    if isinstance(criterion, int) and not isinstance(criterion, bool):
        return TopK(criterion)
    if isinstance(criterion, Criterion):
        return criterion
    raise TypeError(
        "criterion must be an int k (the k largest positive eigenvalues) or a callable "
        f"mapping ascending eigenvalues to indices, got {type(criterion).__name__}."
    )


def selected_indices(criterion: Criterion, evals: Tensor) -> Tensor:
    """Apply a criterion and check its answer (the built-in ones are trusted).

    Args:
        criterion: Callable receiving the ascending eigenvalues.
        evals: Eigenvalues of one GGN block, ascending.

    Returns:
        Sorted ``int64`` index tensor on the eigenvalues' device.

    Raises:
        IndexError: If an index is out of range.
        ValueError: If an index repeats.
    """
    answer = criterion(evals)
    if isinstance(criterion, TopK | EigenvalueThreshold | RelativeThreshold):
        # Sorted, unique and in range by construction.
        return torch.as_tensor(answer, dtype=torch.int64, device=evals.device)
    indices = torch.as_tensor(list(answer), dtype=torch.int64)
    num_evals = evals.numel()
    if indices.numel() and (indices.min() < -num_evals or indices.max() >= num_evals):
        raise IndexError(
            f"The criterion returned indices {indices.tolist()} but there are only "
            f"{num_evals} eigenvalues (valid indices 0..{num_evals - 1})."
        )
    indices = torch.remainder(indices, max(num_evals, 1)).sort().values
    if indices.unique().numel() != indices.numel():
        raise ValueError(f"The criterion repeated indices: {indices.tolist()}.")
    return indices.to(evals.device)


# Policies live in param groups: let `torch.load(weights_only=True)` restore them.
torch.serialization.add_safe_globals([TopK, EigenvalueThreshold, RelativeThreshold])
