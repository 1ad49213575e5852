"""What a group's step gives the optimizer: the direction and the averaged factor."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

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
class GroupStep:
    """A group's direction ``s`` (before the learning rate) and its quadratic model.

    The fields that ViViT's :class:`~dampednewton.computations.NewtonStep` has too
    mean what they mean there, over the ``K`` directions of the step; its
    ``coefficients`` are those of the step taken: the Newton fraction ``φ`` times the
    damped Newton coefficients ``−γ̄_k/(λ̄_k + δ_k)``.

    Attributes:
        direction: ``s``, one tensor per parameter of the group (``p.shape``).
        slope: ``ḡᵀs`` (scalar tensor).
        curvature: ``sᵀGs`` under the step's GGN estimate (scalar tensor).
        evals: The directions' GGN eigenvalues ``[K]``, ascending.
        gamma_mean: Their mean slopes ``γ̄_k`` ``[K]``.
        lambda_mean: Their mean curvatures ``λ̄_k`` ``[K]``.
        damping: Their damping ``δ_k`` ``[K]``.
        coefficients: ``φ c_k`` ``[K]`` (``0`` where a direction is left out).
        selected: ``[K]`` mask of the directions to record, a tail (the others are
            the non-positive ones of a fixed-size :class:`TopK` tail).
        batch_curvature: ``sᵀĜs`` under this batch's GGN ``Ĝ = VVᵀ`` where it was
            computed (``None`` on steps that reuse an averaged factor).
        complement_curvature: ``ρ`` of the complement step, ``None`` without one
            (``inf`` where a policy found no direction to borrow it from).
        curvature_finite: Whether the batch's Gram matrix was finite (0-dim
            tensor; ``None`` without one): if not, the step is refused.
        damping_valid: Whether the damping policy's values are valid (0-dim tensor;
            ``None`` for policies valid by construction): if not, the step raises.
        factor: The updated averaged factor (averaged groups only).
        frozen: The coefficients of the steps until the factor's next refresh
            (:mod:`dampednewton.math.frozen_basis`; averaged groups only).
    """

    direction: tuple[Tensor, ...]
    slope: Tensor
    curvature: Tensor
    evals: Tensor
    gamma_mean: Tensor
    lambda_mean: Tensor
    damping: Tensor
    coefficients: Tensor
    selected: Tensor
    batch_curvature: Tensor | None = None
    complement_curvature: Tensor | None = None
    curvature_finite: Tensor | None = None
    damping_valid: Tensor | None = None
    factor: AveragedFactor | None = None
    frozen: FrozenBasis | None = None
