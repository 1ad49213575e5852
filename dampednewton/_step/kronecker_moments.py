"""The noise filter's moments in the optimizer's state.

Per layer (:class:`~dampednewton.NoiseFilter`), on its first parameter, next to the
eigenpairs: the moments of the kept coefficients ``Γ`` and their bias corrections
(:mod:`dampednewton.math.noise_filter`), in the eigenbasis stored with them. A step
reads them (rotated into a refresh's new eigenvectors), advances them by its ``Γ``
and scales its coefficients; the optimizer commits them with an accepted step only,
like the refreshed factors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from dampednewton._step.kronecker_state import (
    INPUT_EIGEN,
    OUTPUT_EIGEN,
    UPDATES,
    LayerBasis,
)
from dampednewton._step.options import GroupOptions
from dampednewton.math.kronecker import projections
from dampednewton.math.kronecker_coefficients import LayerCoefficients
from dampednewton.math.kronecker_factors import FactorEigen
from dampednewton.math.noise_filter import (
    DirectionMoments,
    advanced,
    filtered,
    rotated,
    signal_fraction,
    stacked_moments,
)
from dampednewton.policies.basis import KroneckerBasis
from dampednewton.policies.noise_filter import NoiseFilter

FIRST_MOMENT = "noise_filter_first_moment"
SECOND_MOMENT = "noise_filter_second_moment"
FIRST_WEIGHT = "noise_filter_first_weight"
SECOND_WEIGHT = "noise_filter_second_weight"
MOMENT_KEYS = frozenset({FIRST_MOMENT, SECOND_MOMENT, FIRST_WEIGHT, SECOND_WEIGHT})
"""Every per-parameter entry the noise filter writes."""
MOMENTS_REFRESH = "noise_filter_refresh"
"""Group statistics: the refresh count whose eigenbases the moments were last
advanced in (moments of an earlier one, e.g. after the filter was off, are stale)."""


def group_noise_filter(option: GroupOptions) -> NoiseFilter | None:
    """The group's noise filter (``None``: none, or not the Kronecker basis)."""
    basis = option.basis
    return basis.noise_filter if isinstance(basis, KroneckerBasis) else None


def current_moments(stats: Mapping[str, Any]) -> bool:
    """Whether the group's stored moments are in its stored eigenbases.

    Args:
        stats: The group's statistics (before this step's refresh is committed).

    Returns:
        ``True`` when the moments were advanced since the last committed refresh.
    """
    return MOMENTS_REFRESH in stats and stats[MOMENTS_REFRESH] == stats.get(UPDATES)


def stored_moments(
    entry: Mapping[str, Any], basis: LayerBasis
) -> DirectionMoments | None:
    """A layer's moments, in ``basis``' eigenvectors (``None``: none stored).

    Call only when the moments are in the stored eigenvectors
    (:func:`current_moments`). When ``basis`` comes from this step's refresh, they
    are rotated into it (``R = U'ᵀU`` is ``r_out' × r_out``: a new rank fits too).

    Args:
        entry: The state of the layer's first parameter (eigenpairs and moments).
        basis: The layer's basis of this step.

    Returns:
        The moments, or ``None`` (also where the layer's factors changed shape).
    """
    old_output = entry.get(f"{OUTPUT_EIGEN}_vectors")
    old_inputs = entry.get(f"{INPUT_EIGEN}_vectors")
    if FIRST_MOMENT not in entry or old_output is None or old_inputs is None:
        return None
    new_output, new_inputs = basis.output.vectors, basis.inputs.vectors
    if old_output.shape[0] != new_output.shape[0] or (
        old_inputs.shape[0] != new_inputs.shape[0]
    ):  # the layer's factors changed shape (a bias frozen or unfrozen): restart
        return None
    moments = DirectionMoments(
        entry[FIRST_MOMENT],
        entry[SECOND_MOMENT],
        entry[FIRST_WEIGHT],
        entry[SECOND_WEIGHT],
    )
    if old_output is new_output and old_inputs is new_inputs:
        return moments
    return rotated(moments, new_output.T @ old_output, old_inputs.T @ new_inputs)


def batch_moments(
    layers: Sequence[LayerBasis], state: Any, current: bool
) -> DirectionMoments | None:
    """The stored moments of layers of one shape (stacked for several; ``None``: none).

    A layer without stored moments in a batch with some starts from zero moments
    with zero bias corrections, as it would alone.

    Args:
        layers: The batch's layers with this step's eigenpairs.
        state: The optimizer's per-parameter state.
        current: Whether the stored moments are in the stored eigenbases
            (:func:`current_moments`; otherwise every layer starts anew).
    """
    each = [
        stored_moments(state[layer.first], layer) if current else None
        for layer in layers
    ]
    if all(moments is None for moments in each):
        return None
    if len(each) == 1:
        return each[0]
    return stacked_moments(
        [
            _zero_moments(layer) if moments is None else moments
            for layer, moments in zip(layers, each, strict=True)
        ]
    )


def _zero_moments(layer: LayerBasis) -> DirectionMoments:
    like = layer.output.values.new_zeros(
        layer.output.values.shape[-1], layer.inputs.values.shape[-1]
    )
    zero = like.new_zeros(())
    return DirectionMoments(like, like, zero, zero)


def filtered_layer(
    gradient: Tensor,
    output: FactorEigen,
    inputs: FactorEigen,
    coefficients: LayerCoefficients,
    moments: DirectionMoments | None,
    noise_filter: NoiseFilter,
    with_curvature: bool,
) -> tuple[LayerCoefficients, tuple[Tensor, Tensor], DirectionMoments]:
    """A layer's (or stacked layers') coefficients scaled by ``ρ`` after ``Γ``.

    Args:
        gradient: The gradient matrix ``Ḡ`` (stacked for several layers).
        output: The eigenpairs of ``S`` of this step.
        inputs: The eigenpairs of ``A`` of this step.
        coefficients: The unfiltered coefficients.
        moments: The moments so far, in these eigenpairs (:func:`batch_moments`).
        noise_filter: The filter's settings.
        with_curvature: Whether the step computes its curvature.

    Returns:
        The scaled coefficients, the projections ``(ḠV, Γ)`` for the direction and
        the advanced (uncommitted) moments.
    """
    projected = projections(gradient, output, inputs)
    beta1, beta2 = noise_filter.beta1, noise_filter.beta2
    moments = advanced(moments, projected[1], beta1, beta2)
    scales = signal_fraction(moments, noise_filter.floor)
    return filtered(coefficients, scales, with_curvature), projected, moments


def moment_entries(moments: DirectionMoments) -> dict[str, Tensor]:
    """The moments as state entries."""
    return {
        FIRST_MOMENT: moments.first,
        SECOND_MOMENT: moments.second,
        FIRST_WEIGHT: moments.first_weight,
        SECOND_WEIGHT: moments.second_weight,
    }
