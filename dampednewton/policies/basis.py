"""Bases: which eigen-directions of a param group's GGN block the step moves along.

* :class:`KroneckerBasis` (the default): per layer, the eigenvectors ``u_i ⊗ v_j`` of
  the Kronecker factors of the layer's GGN block (K-FAC's factors of the GGN's square
  root; :mod:`dampednewton.math.kronecker`). Every direction of the layer is kept,
  with its own curvature ``τ_i σ_j`` and damping; a factor larger than ``rank`` keeps
  its ``rank`` leading eigenvectors and treats the rest of its space as one
  eigenvalue. Covers ``nn.Linear`` and ``nn.Conv1d/2d/3d`` (one group, zero padding
  given by numbers).
* :class:`GramBasis`: the leading eigenvectors of the whole group's GGN block, from
  the small Gram matrix ``VᵀV`` (ViViT's route); the ``criterion`` picks them, the
  ``complement`` covers the rest of the gradient. Any layer BackPACK supports.

Both are picklable frozen dataclasses (``_target_``-selectable in Hydra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_KRONECKER_RANK = 128
"""Eigenvectors kept per Kronecker factor (larger factors share one residual value)."""
ROTATING_REFRESHES = 5
"""Refreshes that all recompute the eigenvectors (the ramp of the default schedule:
steps 0, 1, 3, 7, 15), while the factors change fast."""


@dataclass(frozen=True)
class KroneckerBasis:
    """Per layer, the eigenbasis of the Kronecker factors of its GGN block.

    Attributes:
        rank: Eigenvectors kept per factor (``≥ 1``). A factor of larger dimension
            (e.g. the 785 inputs of a 784-wide layer with bias) keeps its ``rank``
            leading ones; its other eigenvalues are replaced by their mean. A step
            costs four products of each layer's gradient with ``≤ rank`` vectors.
        rotation_interval: Recompute the eigenvectors on the first
            :data:`ROTATING_REFRESHES` refreshes and then on every
            ``rotation_interval``-th (``≥ 1``); the refreshes in between update the
            factors and only the eigenvalues along the kept eigenvectors (their
            Rayleigh quotients): an averaged factor turns slowly.
    """

    rank: int = DEFAULT_KRONECKER_RANK
    rotation_interval: int = 3

    def __post_init__(self) -> None:
        """Validate the settings."""
        for name in ("rank", "rotation_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                error = TypeError if not isinstance(value, int) else ValueError
                raise error(
                    f"KroneckerBasis needs an integer {name} >= 1, got {value!r}."
                )

    def rotates(self, refresh: int) -> bool:
        """Whether refresh number ``refresh`` (from 0) recomputes the eigenvectors.

        Args:
            refresh: Refreshes before this one.

        Returns:
            ``True`` on the first :data:`ROTATING_REFRESHES` and every
            ``rotation_interval``-th after them.
        """
        if refresh < ROTATING_REFRESHES:
            return True
        return (refresh - ROTATING_REFRESHES) % self.rotation_interval == 0


@dataclass(frozen=True)
class GramBasis:
    """The leading eigenvectors of the group's GGN block, from its Gram matrix.

    The ``criterion`` chooses them, the ``complement`` steps along the rest of the
    gradient, ``newton_fraction`` scales the Newton part (ViViT's step with the
    package's additions, see the optimizer's docstring).
    """


Basis = KroneckerBasis | GramBasis
"""The bases a param group can take."""


def as_basis(basis: Any) -> Basis:
    """Check a group's basis.

    Args:
        basis: A :class:`KroneckerBasis` or :class:`GramBasis`.

    Returns:
        The basis.

    Raises:
        TypeError: For anything else.
    """
    if isinstance(basis, KroneckerBasis | GramBasis):
        return basis
    raise TypeError(
        "basis must be KroneckerBasis() (per layer, the default) or GramBasis() "
        f"(the group's leading GGN eigenvectors, ViViT's route), got {basis!r}."
    )


# Loadable with torch.load(weights_only=True), as every policy of the param groups.
torch.serialization.add_safe_globals([KroneckerBasis, GramBasis])
