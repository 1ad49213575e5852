"""What a group's step gives the optimizer: the direction and the averaged factor."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dampednewton.computations.damped_newton import NewtonStep
from dampednewton.math.frozen_basis import FrozenBasis


@dataclass
class AveragedFactor:
    """A group's averaged GGN ``B Bᵀ`` after ``updates`` updates (not bias-corrected).

    Attributes:
        basis: Per parameter of the group, ``B``'s columns ``[r, *p.shape]``.
        weights: ``w = diag(BᵀB)`` ``[r]``, ascending.
        updates: Number of batches averaged in (``t``).
    """

    basis: tuple[Tensor, ...]
    weights: Tensor
    updates: int


@dataclass
class GroupStep(NewtonStep):
    """A group's direction ``s`` (field ``step``) and its quadratic model.

    Its ``coefficients`` are those of the step taken: the Newton fraction ``φ`` times
    the damped Newton coefficients ``−γ̄_k/(λ̄_k + δ_k)``.

    Attributes:
        slope: ``ḡᵀs`` (scalar tensor).
        curvature: ``sᵀGs`` under the step's GGN estimate (scalar tensor).
        batch_curvature: ``sᵀĜs`` under this batch's GGN ``Ĝ = VVᵀ`` where it was
            computed (``None`` on steps that reuse an averaged factor).
        complement_curvature: ``ρ`` of the complement step, ``None`` without one
            (``inf`` where a policy found no direction to borrow it from).
        selected: ``[K]`` mask of the directions to record, a tail (the others are
            the non-positive ones of a fixed-size :class:`TopK` tail).
        curvature_finite: Whether the batch's Gram matrix was finite (0-dim
            tensor; ``None`` without one): if not, the step is refused.
        damping_valid: Whether the damping policy's values are valid (0-dim tensor;
            ``None`` for policies valid by construction): if not, the step raises.
        factor: The updated averaged factor (averaged groups only).
        frozen: The coefficients of the steps until the factor's next refresh
            (:mod:`dampednewton.math.frozen_basis`; averaged groups only).
    """

    slope: Tensor
    curvature: Tensor
    selected: Tensor
    batch_curvature: Tensor | None = None
    complement_curvature: Tensor | None = None
    curvature_finite: Tensor | None = None
    damping_valid: Tensor | None = None
    factor: AveragedFactor | None = None
    frozen: FrozenBasis | None = None
