"""What the Kronecker basis keeps between steps, in the optimizer's state.

Per layer, on its first parameter (the weight, or a bias whose weight is not
optimized): the averaged factors ``A`` and ``S`` (not bias-corrected) and their kept
eigenpairs. Per group, in ``records['groups'][i]``: the layers as pairs of parameter
indices and the number of refreshes. Everything is tensors, numbers and tuples, so
``state_dict()`` survives ``torch.save`` / ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dampednewton.math.kronecker_factors import EIGEN_FIELDS, FactorEigen

LAYERS = "kronecker_layers"
"""Group statistics: each layer as ``(weight index, bias index)`` (``None``: absent)."""


def holder_index(pair: tuple[int | None, int | None]) -> int:
    """The index of the parameter that holds a layer's state (weight, else bias)."""
    weight, bias = pair
    index = bias if weight is None else weight
    assert index is not None
    return index


INPUT_FACTOR = "kronecker_input_factor"
OUTPUT_FACTOR = "kronecker_output_factor"
INPUT_EIGEN = "kronecker_input"
OUTPUT_EIGEN = "kronecker_output"
"""Prefixes of a factor's eigenpairs: ``<prefix>_values``, ``_vectors``, ``_residual``,
``_mean`` (the fields of :class:`~dampednewton.math.kronecker.FactorEigen`)."""
STATE_KEYS = frozenset(
    {INPUT_FACTOR, OUTPUT_FACTOR}
    | {
        f"{prefix}_{name}"
        for prefix in (INPUT_EIGEN, OUTPUT_EIGEN)
        for name in EIGEN_FIELDS
    }
)
"""Every per-parameter entry the Kronecker basis writes."""
UPDATES = "curvature_updates"
"""Group statistics: refreshes so far."""
LAYER_REFRESHES = "kronecker_layer_refreshes"
"""Group statistics: per layer of :data:`LAYERS`, the refreshes its averaged factors
hold (its average's ``t``: fewer than the group's for a layer some refreshes did not
see; absent in checkpoints of earlier versions, where every layer holds them all)."""


def eigen_entries(prefix: str, eigen: FactorEigen) -> dict[str, Tensor]:
    """A factor's eigenpairs as state entries.

    Args:
        prefix: :data:`INPUT_EIGEN` or :data:`OUTPUT_EIGEN`.
        eigen: The eigenpairs.

    Returns:
        ``{<prefix>_<field>: tensor}``.
    """
    return {f"{prefix}_{name}": getattr(eigen, name) for name in EIGEN_FIELDS}


def stored_eigen(entry: Mapping[str, Any], prefix: str) -> FactorEigen | None:
    """A factor's eigenpairs from a parameter's state (``None``: not stored).

    Args:
        entry: The parameter's state.
        prefix: :data:`INPUT_EIGEN` or :data:`OUTPUT_EIGEN`.

    Returns:
        The eigenpairs, or ``None``.
    """
    if f"{prefix}_values" not in entry:
        return None
    return FactorEigen(**{name: entry[f"{prefix}_{name}"] for name in EIGEN_FIELDS})


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
            parts.append(
                parameter_gradient(self.weight, like).reshape(self.weight.shape[0], -1)
            )
        if self.bias is not None:
            parts.append(parameter_gradient(self.bias, like)[:, None])
        return parts[0] if len(parts) == 1 else _concatenated(parts)

    def split(self, direction: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Pair each parameter with its part of a direction matrix.

        Args:
            direction: ``[d_out, d_in (+1)]``.

        Returns:
            ``(parameter, direction of its shape)`` for the weight and the bias.
        """
        if self.weight is None:
            assert self.bias is not None
            return [(self.bias, direction[:, -1])]
        if self.bias is None:
            return [(self.weight, direction.reshape(self.weight.shape))]
        weight = direction[:, :-1]
        if self.weight.dim() > 2:  # a convolution's filters
            weight = weight.reshape(self.weight.shape)
        return [(self.weight, weight), (self.bias, direction[:, -1])]


def parameter_gradient(param: Tensor, like: Tensor) -> Tensor:
    """A parameter's ``.grad`` in ``like``'s dtype (zeros where there is none)."""
    grad = param.grad
    if grad is None or not param.requires_grad:
        return like.new_zeros(param.shape)
    return grad if grad.dtype == like.dtype else grad.to(like.dtype)


def _concatenated(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts, dim=1)


def bases_in_state(layers: Sequence[LayerBasis], state: Mapping[Any, Any]) -> bool:
    """Whether the layers' eigenpairs are still the state's own tensors.

    Not after the state's tensors were replaced (moved to another device, edited):
    then the cached bases are stale and are read from the state again.

    Args:
        layers: Cached layer bases.
        state: The optimizer's per-parameter state.

    Returns:
        Whether every eigenpair tensor of every layer is the one in the state.
    """
    for layer in layers:
        entry = state[layer.first]
        for prefix, eigen in (
            (OUTPUT_EIGEN, layer.output),
            (INPUT_EIGEN, layer.inputs),
        ):
            for name in EIGEN_FIELDS:
                if entry.get(f"{prefix}_{name}") is not getattr(eigen, name):
                    return False
    return True


def eigen_versions(layers: Sequence[LayerBasis]) -> tuple[int, ...]:
    """The version counters of the layers' eigenpair tensors (in-place edits bump them).

    Args:
        layers: Layer bases.

    Returns:
        Every eigenpair tensor's ``_version``, in order.
    """
    return tuple(
        getattr(eigen, name)._version
        for layer in layers
        for eigen in (layer.output, layer.inputs)
        for name in EIGEN_FIELDS
    )


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
        output = stored_eigen(state[first], OUTPUT_EIGEN)
        inputs = stored_eigen(state[first], INPUT_EIGEN)
        if output is None or inputs is None:
            return None
        bases.append(LayerBasis(weight, bias, output, inputs))
    return bases
