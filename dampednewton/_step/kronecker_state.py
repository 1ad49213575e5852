"""What the Kronecker basis keeps between steps, in the optimizer's state.

Per layer, on its first parameter (the weight, or a bias whose weight is not
optimized): the averaged factors ``A`` and ``S`` (not bias-corrected) and their kept
eigenpairs. Per group, in ``state['groups'][i]``: the layers as pairs of parameter
indices and the number of refreshes. Everything is tensors, numbers and tuples, so
``state_dict()`` survives ``torch.save`` / ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from dampednewton.math.kronecker import (
    FactorEigen,
    LayerCoefficients,
    layer_coefficients,
)

LAYERS = "kronecker_layers"
"""Group statistics: each layer as ``(weight index, bias index)`` (``None``: absent)."""
INPUT_FACTOR = "kronecker_input_factor"
OUTPUT_FACTOR = "kronecker_output_factor"
INPUT_EIGEN = "kronecker_input_eigen"
OUTPUT_EIGEN = "kronecker_output_eigen"
UPDATES = "curvature_updates"
"""Group statistics: refreshes so far (the averages' ``t``)."""


def eigen_entries(eigen: FactorEigen) -> dict[str, Tensor]:
    """A factor's eigenpairs as a dict of tensors (for the state).

    Args:
        eigen: The eigenpairs.

    Returns:
        ``{field: tensor}``.
    """
    return {field.name: getattr(eigen, field.name) for field in fields(eigen)}


@dataclass
class LayerBasis:
    """A layer's parameters and the eigenpairs its steps use until the next refresh.

    Attributes:
        weight: The weight (``None``: a bias alone).
        bias: The bias (``None``: none, or not optimized with the weight).
        output: Eigenpairs of ``S``.
        inputs: Eigenpairs of ``A``.
    """

    weight: Tensor | None
    bias: Tensor | None
    output: FactorEigen
    inputs: FactorEigen
    _coefficients: tuple[float, LayerCoefficients] | None = field(
        default=None, repr=False
    )

    def coefficients(self, damping: float) -> LayerCoefficients:
        """The step's coefficients for ``δ = damping`` (kept while ``δ`` holds)."""
        if self._coefficients is None or self._coefficients[0] != damping:
            coefficients = layer_coefficients(self.output, self.inputs, damping)
            self._coefficients = (damping, coefficients)
        return self._coefficients[1]

    @property
    def first(self) -> Tensor:
        """The parameter that holds the layer's state."""
        first = self.weight if self.weight is not None else self.bias
        assert first is not None
        return first

    def gradient(self, like: Tensor) -> Tensor:
        """The layer's gradient as a matrix ``[d_out, d_in (+1)]`` of ``like``'s dtype.

        A parameter without ``.grad`` contributes zeros.
        """
        parts = []
        if self.weight is not None:
            parts.append(_grad(self.weight, like).reshape(self.weight.shape[0], -1))
        if self.bias is not None:
            parts.append(_grad(self.bias, like)[:, None])
        return parts[0] if len(parts) == 1 else _concatenated(parts)

    def split(self, direction: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Pair each parameter with its part of a direction matrix.

        Args:
            direction: ``[d_out, d_in (+1)]``.

        Returns:
            ``(parameter, direction of its shape)`` for the weight and the bias.
        """
        pairs = []
        if self.weight is not None:
            width = self.weight[0].numel()
            pairs.append((self.weight, direction[:, :width].reshape(self.weight.shape)))
        if self.bias is not None:
            pairs.append((self.bias, direction[:, -1]))
        return pairs


def _grad(param: Tensor, like: Tensor) -> Tensor:
    if param.grad is None or not param.requires_grad:
        return like.new_zeros(param.shape)
    return param.grad.to(like.dtype)


def _concatenated(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts, dim=1)


def stored_bases(
    state: Mapping[Any, dict[str, Any]],
    stats: Mapping[str, Any],
    params: Sequence[Tensor],
) -> list[LayerBasis] | None:
    """A group's layer bases from the state (``None`` before its first refresh).

    Args:
        state: The optimizer's state.
        stats: The group's statistics.
        params: The group's parameters.

    Returns:
        The layers' bases, or ``None``.
    """
    pairs = stats.get(LAYERS)
    if not pairs or stats.get(UPDATES, 0) == 0:
        return None
    bases = []
    for weight_index, bias_index in pairs:
        weight = None if weight_index is None else params[weight_index]
        bias = None if bias_index is None else params[bias_index]
        first = weight if weight is not None else bias
        entry = state[first]
        bases.append(
            LayerBasis(
                weight,
                bias,
                FactorEigen(**entry[OUTPUT_EIGEN]),
                FactorEigen(**entry[INPUT_EIGEN]),
            )
        )
    return bases
