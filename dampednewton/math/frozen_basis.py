r"""The step between curvature refreshes, along a frozen basis (pure tensor math).

A refresh leaves each group an averaged factor ``B`` (``r`` columns ``√w_i u_i``,
orthonormal ``u_i``), curvatures ``λ_i``, dampings ``δ_i``, the Newton fraction
``φ`` and the complement curvature ``ρ``. Until the next refresh only the mean
gradient ``ḡ`` is new, and the step

.. math::

    s = \sum_i \frac{-\varphi\,\gamma_i}{\lambda_i + \delta_i} u_i
        - \frac{1}{\rho}\Big(\bar g - \sum_i \gamma_i u_i\Big),
    \qquad \gamma_i = u_i^\top \bar g,

needs two products with the ``r×D`` matrix ``B`` and nothing else of size ``D``:
with ``π = B ḡ`` (so ``γ_i = π_i / √w_i``) it is ``s = Bᵀ(b ⊙ π) − ḡ/ρ`` with
``b_i = (a_i + 1/ρ) / w_i`` and ``a_i = −φ/(λ_i + δ_i)``. The quadratic model's
slope is ``ḡᵀs`` and its curvature along the kept directions
``Σ_i λ_i a_i² γ_i² = Σ_i c_i π_i²`` with ``c_i = λ_i a_i² / w_i``; the trust region
uses both (:func:`dampednewton._step.quadratic_model.trust_region_scale`).

:class:`FrozenBasis` holds ``b``, ``c`` and ``1/ρ`` (computed once per refresh by
:func:`freeze`); :func:`frozen_basis_step` is the step. Columns that the criterion
did not choose, or whose weight is not positive, get ``b_i = c_i = 0`` and stay
in the complement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

SCALAR_FIELDS = ("inverse_complement", "curvature_excess", "step_length")
"""The 0-dim fields of :class:`FrozenBasis` (the others have one entry per column)."""


@dataclass(frozen=True)
class FrozenBasis:
    """A group's step coefficients between refreshes (everything but ``B``).

    Attributes:
        weights: ``w`` ``[r]``.
        curvatures: ``λ`` ``[r]``.
        damping: ``δ`` ``[r]``.
        kept: ``[r]`` mask of the directions the step takes.
        newton: ``a`` ``[r]``: ``a_i γ_i`` is the Newton step's coefficient.
        step_weights: ``b`` ``[r]``: ``Bᵀ(b ⊙ Bḡ)`` is the step inside span(B).
        curvature_weights: ``c`` ``[r]``: ``Σ c_i π_i²`` is the model's curvature.
        inverse_complement: ``1/ρ`` (0-dim; ``0`` without a complement step).
        curvature_excess: ``η ≥ 1`` (0-dim): how much the refreshing batch's GGN
            exceeded the damped model's curvature along the refresh's step. The
            trust region of the steps until the next refresh bounds ``−η ḡᵀs``:
            the model keeps no batch GGN to check against.
        step_length: ``ν‖s‖`` of the refresh's own step (before the learning
            rate; ``inf`` until it is known): the steps until the next refresh are
            no longer, so that a frozen curvature that no longer holds cannot throw
            the model far (:func:`guarded_curvature`).
    """

    weights: Tensor
    curvatures: Tensor
    damping: Tensor
    kept: Tensor
    newton: Tensor
    step_weights: Tensor
    curvature_weights: Tensor
    inverse_complement: Tensor
    curvature_excess: Tensor
    step_length: Tensor

    def without_first(self, count: int) -> FrozenBasis:
        """The coefficients of the columns from ``count`` on (copies).

        Args:
            count: Number of leading columns to drop.

        Returns:
            The coefficients of the remaining columns.
        """
        entries = self.as_dict()
        scalars = {name: entries.pop(name) for name in SCALAR_FIELDS}
        columns = {name: value[count:].clone() for name, value in entries.items()}
        return FrozenBasis(**columns, **scalars)

    def as_dict(self) -> dict[str, Tensor]:
        """The fields as a dict of tensors (for the optimizer's state dict).

        Returns:
            ``{field name: tensor}``.
        """
        return {field.name: getattr(self, field.name) for field in fields(self)}


@dataclass(frozen=True)
class BasisStep:
    """The step along a frozen basis and its quadratic model.

    Attributes:
        direction: ``s`` ``[D]`` (flat, in the basis' dtype).
        projections: ``π = Bḡ`` ``[r]``.
        slope: ``ḡᵀs`` (0-dim).
    """

    direction: Tensor
    projections: Tensor
    slope: Tensor

    def curvature(self, frozen: FrozenBasis) -> Tensor:
        """``sᵀḠs`` under the averaged GGN: ``Σ_i c_i π_i²`` (0-dim).

        Args:
            frozen: The coefficients the step was taken with.

        Returns:
            The quadratic model's curvature along the step.
        """
        return torch.dot(self.projections.square(), frozen.curvature_weights)


def freeze(
    weights: Tensor,
    curvatures: Tensor,
    damping: Tensor,
    chosen: Tensor,
    newton_fraction: float,
    complement_curvature: Tensor | None,
    curvature_excess: Tensor,
) -> FrozenBasis:
    """The coefficients of the steps until the next refresh.

    Args:
        weights: ``w`` ``[r]`` (``BᵀB``'s diagonal; ``0`` for empty columns).
        curvatures: ``λ`` ``[r]`` (the bias-corrected average's eigenvalues).
        damping: ``δ`` ``[r]`` (``inf`` drops a direction; unchosen columns any
            value).
        chosen: ``[r]`` mask of the columns the criterion kept.
        newton_fraction: ``φ``.
        complement_curvature: ``ρ`` (0-dim, ``inf``: none), or ``None`` without a
            complement step.
        curvature_excess: ``η`` (see :class:`FrozenBasis`).

    Returns:
        The frozen coefficients.
    """
    kept = chosen & (weights > 0) & torch.isfinite(damping)
    safe_weights = weights.where(kept, 1.0)
    newton = (-newton_fraction / (curvatures + damping.where(kept, 1.0))).where(
        kept, 0.0
    )
    if complement_curvature is None:
        inverse = weights.new_zeros(())
    else:
        inverse = complement_curvature.to(weights).reciprocal()
    return FrozenBasis(
        weights=weights,
        curvatures=curvatures,
        damping=damping,
        kept=kept,
        newton=newton,
        step_weights=((newton + inverse) / safe_weights).where(kept, 0.0),
        curvature_weights=(curvatures * newton.square() / safe_weights).where(
            kept, 0.0
        ),
        inverse_complement=inverse,
        curvature_excess=curvature_excess.to(weights),
        step_length=weights.new_full((), torch.inf),
    )


def frozen_basis_step(
    basis: Tensor, gradient: Tensor, frozen: FrozenBasis
) -> BasisStep:
    """The step ``s = Bᵀ(b ⊙ Bḡ) − ḡ/ρ`` and its model (see the module docstring).

    Args:
        basis: ``B`` ``[r, D]`` (rows ``√w_i u_iᵀ``).
        gradient: ``ḡ`` ``[D]`` in ``B``'s dtype.
        frozen: The coefficients from :func:`freeze`.

    Returns:
        The step with its slope and curvature.
    """
    projections = basis @ gradient
    step = torch.addmv(
        gradient * -frozen.inverse_complement,
        basis.T,
        projections * frozen.step_weights,
    )
    return BasisStep(
        direction=step, projections=projections, slope=torch.dot(gradient, step)
    )


def guarded_curvature(
    step: BasisStep, frozen: FrozenBasis, bound: float | None
) -> Tensor:
    """The curvature the trust region bounds for a step along a frozen basis.

    ``max(−η ḡᵀs, bound ‖s‖² / L²)`` with ``L`` the refresh's step length: the
    trust-region scale ``ν = min(1, √(bound / curvature))`` then keeps the step's
    damped model within ``bound`` as at a refresh and its length ``ν‖s‖`` within
    ``L``.

    Args:
        step: The step.
        frozen: The group's frozen coefficients.
        bound: ``2κ`` of the trust region, ``None`` without one.

    Returns:
        The curvature (0-dim).
    """
    model = -step.slope * frozen.curvature_excess
    if bound is None:
        return model
    length = step.direction.square().sum() / frozen.step_length.square()
    return torch.maximum(model, bound * length)


def trust_scale_on_host(
    slope: float,
    squared_length: float,
    frozen_excess: float,
    frozen_length: float,
    bound: float | None,
) -> float:
    """``ν`` of :func:`guarded_curvature` from values already read to the host.

    The lean path reads the step's slope and squared length with its other checks
    in one transfer and finishes the trust region in Python (no small device
    operations); the result equals ``trust_region_scale`` of the guarded curvature.

    Args:
        slope: ``ḡᵀs``.
        squared_length: ``‖s‖²``.
        frozen_excess: ``η``.
        frozen_length: ``L``.
        bound: ``2κ``, ``None`` without a trust region.

    Returns:
        ``ν = min(1, √(bound / max(−η ḡᵀs, bound ‖s‖² / L²)))``.
    """
    if bound is None:
        return 1.0
    if frozen_length == 0:
        longest = math.inf if squared_length > 0 else 0.0
    else:
        longest = bound * squared_length / frozen_length**2
    curvature = max(-slope * frozen_excess, longest)
    return 1.0 if curvature <= bound else math.sqrt(bound / curvature)
