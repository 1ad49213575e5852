"""A group's Kronecker direction, its layers of one shape stepped together.

:func:`group_step` computes every layer's damped Newton direction
(:func:`~dampednewton.math.kronecker.kronecker_direction`; with a
:class:`~dampednewton.NoiseFilter`, its kept coefficients scaled by
:mod:`._step.kronecker_moments`) and sums the slopes and curvatures into the group's
quadratic model.

A Kronecker step costs a fixed number of small products per layer, and on a deep
network of repeated blocks the Python and dispatch overhead of those products grows
with the number of layers. :func:`layer_batches` groups a group's layers by their
shapes (weight, bias, kept eigenvectors, dtype and device): a batch of several layers
stacks their eigenpairs once per refresh (their coefficients follow, once per damping),
stacks their gradients on every step, and computes every layer's direction in one
call of :func:`~dampednewton.math.kronecker.kronecker_direction` (batched products).
A layer of a shape of its own is a batch of one and takes the unbatched path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.kronecker_moments import batch_moments, filtered_layer
from dampednewton._step.kronecker_state import LayerBasis, parameter_gradient
from dampednewton.math.kronecker import kronecker_direction, stacked_eigen
from dampednewton.math.kronecker_coefficients import (
    LayerCoefficients,
    layer_coefficients,
)
from dampednewton.math.kronecker_factors import FactorEigen
from dampednewton.math.noise_filter import DirectionMoments, unstacked_moments
from dampednewton.policies.noise_filter import NoiseFilter


@dataclass
class LayerBatch:
    """Layers of one shape and their stacked eigenpairs.

    Attributes:
        layers: The layers (one, or several of equal shapes).
        output: Eigenpairs of the ``S`` factors (stacked along a first dimension
            for several layers).
        inputs: Eigenpairs of the ``A`` factors (likewise).
    """

    layers: list[LayerBasis]
    output: FactorEigen
    inputs: FactorEigen
    _coefficients: tuple[float, LayerCoefficients] | None = field(
        default=None, repr=False
    )

    @property
    def stacked(self) -> bool:
        """Whether the batch holds several layers (its tensors are stacked)."""
        return len(self.layers) > 1

    def coefficients(self, damping: float, with_curvature: bool) -> LayerCoefficients:
        """The layers' step coefficients for ``δ = damping`` (kept while it holds).

        Their curvature fields are computed when ``with_curvature`` first asks.
        """
        cached = self._coefficients
        if (
            cached is None
            or cached[0] != damping
            or (with_curvature and cached[1].curvatures is None)
        ):
            coefficients = layer_coefficients(
                self.output, self.inputs, damping, with_curvature
            )
            self._coefficients = cached = (damping, coefficients)
        return cached[1]

    def gradient(self, like: Tensor) -> Tensor:
        """The layers' gradient matrices ``[(L,) d_out, d_in (+1)]`` (``like``'s dtype).

        A parameter without ``.grad`` contributes zeros.
        """
        if not self.stacked:
            return self.layers[0].gradient(like)
        first = self.layers[0]
        parts = []
        if first.weight is not None:
            weights = [layer.weight for layer in self.layers]
            gradients = [parameter_gradient(w, like) for w in weights if w is not None]
            parts.append(torch.stack(gradients).flatten(2))
        if first.bias is not None:
            biases = [layer.bias for layer in self.layers]
            gradients = [parameter_gradient(b, like) for b in biases if b is not None]
            parts.append(torch.stack(gradients).unsqueeze(-1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def split(self, direction: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Pair each parameter with its part of the directions.

        Args:
            direction: ``[(L,) d_out, d_in (+1)]``.

        Returns:
            ``(parameter, direction of its shape)`` for every weight and bias.
        """
        if not self.stacked:
            return self.layers[0].split(direction)
        return [
            pair
            for layer, matrix in zip(self.layers, direction.unbind(0), strict=True)
            for pair in layer.split(matrix)
        ]


def layer_batches(layers: Sequence[LayerBasis]) -> list[LayerBatch]:
    """Group layers of equal shapes into batches (in the order of first appearance).

    Args:
        layers: A group's layers with their eigenpairs.

    Returns:
        The batches.
    """
    groups: dict[tuple, list[LayerBasis]] = {}
    for layer in layers:
        groups.setdefault(_shape_key(layer), []).append(layer)
    return [_batch(members) for members in groups.values()]


def _batch(layers: list[LayerBasis]) -> LayerBatch:
    if len(layers) == 1:
        return LayerBatch(layers, layers[0].output, layers[0].inputs)
    return LayerBatch(
        layers,
        stacked_eigen([layer.output for layer in layers]),
        stacked_eigen([layer.inputs for layer in layers]),
    )


def _shape_key(layer: LayerBasis) -> tuple:
    """What layers must share to be stepped together."""
    vectors = layer.output.vectors
    return (
        None if layer.weight is None else tuple(layer.weight.shape),
        None if layer.bias is None else tuple(layer.bias.shape),
        tuple(vectors.shape),
        tuple(layer.inputs.vectors.shape),
        vectors.dtype,
        vectors.device,
    )


@dataclass(frozen=True)
class KroneckerGroupStep:
    """A group's direction and quadratic model (what adaptive damping reads).

    Attributes:
        directions: ``(parameter, its direction s)`` pairs.
        slope: ``ḡᵀs`` (0-dim).
        curvature: ``sᵀ(S ⊗ A)s`` summed over the layers (0-dim).
        moments: With a noise filter, ``(layer's first parameter, its advanced
            moments)`` to commit with the accepted step.
    """

    directions: list[tuple[Tensor, Tensor]]
    slope: Tensor
    curvature: Tensor
    moments: list[tuple[Tensor, DirectionMoments]] = field(default_factory=list)


def group_step(
    batches: Sequence[LayerBatch],
    damping: float,
    with_curvature: bool,
    noise_filter: NoiseFilter | None = None,
    state: Any = None,
    moments_current: bool = False,
) -> KroneckerGroupStep:
    """A group's step along its layers' Kronecker eigenbases.

    Args:
        batches: The group's layers with their eigenpairs, batched by shape
            (:func:`layer_batches`).
        damping: ``δ``.
        with_curvature: Also sum the layers' curvatures (adaptive damping reads
            them); otherwise the curvature is NaN.
        noise_filter: Scale the kept directions by their gradient's steadiness
            (its moments read from ``state``; the advanced ones returned).
        state: The optimizer's per-parameter state (with a filter).
        moments_current: Whether the stored moments are in the stored eigenbases
            (:func:`current_moments`; otherwise they start anew).

    Returns:
        The directions of every parameter, the group's quadratic model and, with a
        filter, every layer's advanced moments (uncommitted).
    """
    directions: list[tuple[Tensor, Tensor]] = []
    slopes, curvatures = [], []
    moments: list[tuple[Tensor, DirectionMoments]] = []
    for batch in batches:
        gradient = batch.gradient(batch.output.vectors)
        coefficients = batch.coefficients(damping, with_curvature)
        projected = None
        if noise_filter is not None:
            coefficients, projected, advanced = filtered_layer(
                gradient,
                batch.output,
                batch.inputs,
                coefficients,
                batch_moments(batch.layers, state, moments_current),
                noise_filter,
                with_curvature,
            )
            each = unstacked_moments(advanced) if batch.stacked else [advanced]
            moments += [
                (layer.first, layer_moments)
                for layer, layer_moments in zip(batch.layers, each, strict=True)
            ]
        layer = kronecker_direction(
            gradient,
            batch.output,
            batch.inputs,
            coefficients,
            with_curvature,
            projected,
        )
        directions += batch.split(layer.direction)
        slopes.append(layer.slope.sum() if batch.stacked else layer.slope)
        if layer.curvature is not None:
            curvatures.append(
                layer.curvature.sum() if batch.stacked else layer.curvature
            )
    slope = slopes[0] if len(slopes) == 1 else torch.stack(slopes).sum()
    if not with_curvature:
        curvature = slope.new_full((), math.nan)
    else:
        curvature = torch.stack(curvatures).sum()
    return KroneckerGroupStep(directions, slope, curvature, moments)
