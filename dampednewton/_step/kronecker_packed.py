"""All of a group's layers in one padded batch (``KroneckerBasis(packed=True)``).

:class:`PackedLayers` pads a group's layer batches (:func:`~._step.kronecker_group.
layer_batches`) into one (:mod:`dampednewton.math.kronecker_packed`) once per refresh
and per damping, and keeps a zero-padded gradient buffer: a step copies every
layer's ``.grad`` into it with one multi-tensor copy and computes all directions with
one call of :func:`~dampednewton.math.kronecker.kronecker_direction`, a fixed number
of operators whatever the number and shapes of the layers. The directions are views
of the padded result. Steps with a noise filter or an adaptive damping, and groups
whose layers differ in dtype or device, take :func:`~._step.kronecker_group.group_step`
instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dampednewton._step.kronecker_group import KroneckerGroupStep, LayerBatch
from dampednewton._step.kronecker_state import LayerBasis
from dampednewton.math.kronecker import LayerCoefficients, kronecker_direction
from dampednewton.math.kronecker_packed import padded_coefficients, padded_eigen


def packable(batches: Sequence[LayerBatch]) -> bool:
    """Whether the batches share a dtype and a device (one padded batch holds them)."""
    first = batches[0].output.vectors
    return all(
        batch.output.vectors.dtype == first.dtype
        and batch.output.vectors.device == first.device
        for batch in batches
    )


class PackedLayers:
    """A group's layer batches as one padded batch, with its gradient buffer."""

    def __init__(self, batches: Sequence[LayerBatch]) -> None:
        """Pad the batches' eigenpairs (their coefficients follow per damping).

        Args:
            batches: The group's layer batches of one refresh.
        """
        self.batches = tuple(batches)
        self.layers: list[LayerBasis] = [
            layer for batch in batches for layer in batch.layers
        ]
        self.output = padded_eigen([batch.output for batch in batches])
        self.inputs = padded_eigen([batch.inputs for batch in batches])
        like = self.output.vectors
        shape = (len(self.layers), like.shape[-2], self.inputs.vectors.shape[-2])
        self._gradient = like.new_zeros(shape)
        self._targets: list[Tensor] = []
        for index, layer in enumerate(self.layers):
            block = self._gradient[index]
            if layer.weight is not None:
                rows, columns = layer.weight.shape[0], math.prod(layer.weight.shape[1:])
                self._targets.append(block[:rows, :columns])
                if layer.bias is not None:
                    self._targets.append(block[:rows, columns])
            else:
                assert layer.bias is not None
                self._targets.append(block[: layer.bias.shape[0], 0])
        self._coefficients: tuple[float, LayerCoefficients] | None = None

    def holds(self, batches: Sequence[LayerBatch]) -> bool:
        """Whether these are the batches this pack was built from."""
        return len(batches) == len(self.batches) and all(
            mine is theirs for mine, theirs in zip(self.batches, batches, strict=True)
        )

    def coefficients(self, damping: float) -> LayerCoefficients:
        """The layers' padded coefficients for ``δ = damping`` (kept while it holds)."""
        cached = self._coefficients
        if cached is None or cached[0] != damping:
            ranks = (self.output.vectors.shape[-1], self.inputs.vectors.shape[-1])
            each = [batch.coefficients(damping, False) for batch in self.batches]
            cached = self._coefficients = (damping, padded_coefficients(each, ranks))
        return cached[1]

    def gradient(self) -> Tensor:
        """Every layer's ``.grad`` in the padded buffer ``[L, O, I]`` (one copy).

        A parameter without ``.grad`` (or frozen) contributes zeros. The buffer is
        overwritten by the next step.
        """
        sources = []
        for layer in self.layers:
            for param in (layer.weight, layer.bias):
                if param is None:
                    continue
                grad = param.grad if param.requires_grad else None
                if grad is None:
                    grad = torch.zeros_like(param)
                sources.append(
                    grad.reshape(grad.shape[0], -1) if grad.dim() > 1 else grad
                )
        torch._foreach_copy_(self._targets, sources)
        return self._gradient

    def step(self, damping: float) -> KroneckerGroupStep:
        """The group's directions and slope (its curvature is left out: NaN).

        Args:
            damping: ``δ``.

        Returns:
            The step, its directions views of the padded result.
        """
        layer = kronecker_direction(
            self.gradient(),
            self.output,
            self.inputs,
            self.coefficients(damping),
            with_curvature=False,
        )
        directions = []
        for index, basis in enumerate(self.layers):
            rows, columns = _block(basis)
            directions += basis.split(layer.direction[index, :rows, :columns])
        slope = layer.slope.sum()
        return KroneckerGroupStep(directions, slope, slope.new_full((), math.nan))


def _block(layer: LayerBasis) -> tuple[int, int]:
    """``(d_out, d_in (+1))`` of a layer's gradient matrix."""
    if layer.weight is None:
        assert layer.bias is not None
        return layer.bias.shape[0], 1
    columns = math.prod(layer.weight.shape[1:]) + (1 if layer.bias is not None else 0)
    return layer.weight.shape[0], columns
