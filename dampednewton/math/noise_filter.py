r"""SOAP's moments of the gradient in a Kronecker eigenbasis, as per-direction scales.

For a layer's kept eigenvectors ``U`` (of ``S``) and ``V`` (of ``A``) and its gradient
``Ḡ``, the coefficients ``Γ = UᵀḠV`` update two moments

.. math::

    M \leftarrow \beta_1 M + (1 - \beta_1)\,\Gamma, \qquad
    W \leftarrow \beta_2 W + (1 - \beta_2)\,\Gamma \odot \Gamma,

and each kept direction's Newton coefficient is scaled by

.. math::

    \rho_{ij} = \max\Bigl(\mathrm{floor}, \min\Bigl(1,
    \frac{|M_{ij}| / (1 - \beta_1^t)}{\sqrt{W_{ij} / (1 - \beta_2^t)}}\Bigr)\Bigr)

(where ``W = 0`` the gradient never had a component and the step is zero whatever
``ρ``); the bias corrections ``1 − βᵗ`` are kept as tensors next to the moments (no
host reads). When the
eigenvectors change to ``U'``, ``V'``, the moments move with the rotations
``R = U'ᵀU`` and ``Q = VᵀV'``: ``M ← R M Q`` (exact within the kept subspaces) and
``W ← (R⊙R) W (Q⊙Q)`` (exact when the coefficients' fluctuations are uncorrelated
across directions; SOAP's approximation). Pure tensor functions (moments of layers of
one shape may be stacked along a first dimension); the optimizer keeps the moments in
its state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.math.kronecker_coefficients import LayerCoefficients


@dataclass(frozen=True)
class DirectionMoments:
    """A layer's moments of ``Γ`` in its kept eigenbasis.

    Attributes:
        first: ``M`` ``[r_out, r_in]``.
        second: ``W`` ``[r_out, r_in]``.
        first_weight: ``1 − β₁ᵗ`` (0-dim; ``M``'s bias correction, on the device).
        second_weight: ``1 − β₂ᵗ`` (0-dim).
    """

    first: Tensor
    second: Tensor
    first_weight: Tensor
    second_weight: Tensor


MOMENT_FIELDS = tuple(f.name for f in dataclasses.fields(DirectionMoments))


def advanced(
    moments: DirectionMoments | None, gamma: Tensor, beta1: float, beta2: float
) -> DirectionMoments:
    """The moments after the coefficients ``gamma`` (out of place).

    Args:
        moments: The moments so far in ``gamma``'s basis (``None``: none yet).
        gamma: ``Γ`` ``[r_out, r_in]``.
        beta1: ``β₁``.
        beta2: ``β₂``.

    Returns:
        The updated moments.
    """
    if moments is None:
        zero = gamma.new_zeros(gamma.shape[:-2])  # a bias correction per layer
        moments = DirectionMoments(
            torch.zeros_like(gamma), torch.zeros_like(gamma), zero, zero
        )
    return DirectionMoments(
        torch.lerp(moments.first, gamma, 1 - beta1),
        torch.lerp(moments.second, gamma.square(), 1 - beta2),
        torch.lerp(
            moments.first_weight, torch.ones_like(moments.first_weight), 1 - beta1
        ),
        torch.lerp(
            moments.second_weight, torch.ones_like(moments.second_weight), 1 - beta2
        ),
    )


def stacked_moments(moments: Sequence[DirectionMoments]) -> DirectionMoments:
    """Moments of layers of one shape stacked along a new first dimension."""
    return DirectionMoments(
        *(torch.stack([getattr(m, name) for m in moments]) for name in MOMENT_FIELDS)
    )


def unstacked_moments(moments: DirectionMoments) -> list[DirectionMoments]:
    """Each layer's moments from :func:`stacked_moments`' stack."""
    parts = [getattr(moments, name).unbind(0) for name in MOMENT_FIELDS]
    return [DirectionMoments(*layer) for layer in zip(*parts, strict=True)]


def rotated(
    moments: DirectionMoments, output_rotation: Tensor, input_rotation: Tensor
) -> DirectionMoments:
    """The moments in a new eigenbasis.

    Args:
        moments: The moments in the old basis.
        output_rotation: ``R = U'ᵀU`` ``[r_out', r_out]``.
        input_rotation: ``Q = VᵀV'`` ``[r_in, r_in']``.

    Returns:
        ``R M Q`` and ``(R⊙R) W (Q⊙Q)``, the bias corrections kept.
    """
    return DirectionMoments(
        output_rotation @ moments.first @ input_rotation,
        output_rotation.square() @ moments.second @ input_rotation.square(),
        moments.first_weight,
        moments.second_weight,
    )


def signal_fraction(moments: DirectionMoments, floor: float) -> Tensor:
    """``ρ``: each direction's bias-corrected ``|m̂|/√v̂`` within ``[floor, 1]``.

    Where ``W = 0`` the gradient never had a component (this step's included), so
    the direction's step is zero whatever ``ρ``: there ``ρ = floor``.

    Args:
        moments: The moments (after at least one update).
        floor: The least ``ρ``.

    Returns:
        ``ρ`` ``[r_out, r_in]``.
    """
    second = moments.second.clamp_min(torch.finfo(moments.second.dtype).tiny)
    correction = (moments.second_weight.sqrt() / moments.first_weight)[..., None, None]
    ratio = moments.first.abs() * second.rsqrt() * correction
    return ratio.clamp(min=floor, max=1.0)


def filtered(
    coefficients: LayerCoefficients, scales: Tensor, with_curvature: bool = True
) -> LayerCoefficients:
    """The coefficients with the kept block's Newton coefficients scaled by ``ρ``.

    The kept block's total coefficient ``−c_kk`` becomes ``−ρ c_kk`` (its slope
    ``ρ`` and its curvature ``ρ²`` times as large); the residual blocks stay.

    Args:
        coefficients: The layer's
            :func:`~dampednewton.math.kronecker_coefficients.layer_coefficients`.
        scales: ``ρ`` ``[r_out, r_in]``.
        with_curvature: Also scale the curvatures (otherwise left as they were: a
            step that does not compute its curvature does not read them).

    Returns:
        The scaled coefficients.
    """
    slopes = coefficients.slopes * scales
    full = coefficients.rows is None and coefficients.columns is None
    # Without residual blocks the core is the kept block's −c_kk itself.
    core = slopes if full else coefficients.core - coefficients.slopes + slopes
    curvatures = coefficients.curvatures
    if with_curvature:
        assert curvatures is not None, "coefficients computed without curvatures"
        curvatures = curvatures * scales.square()
    return dataclasses.replace(
        coefficients, core=core, slopes=slopes, curvatures=curvatures
    )
