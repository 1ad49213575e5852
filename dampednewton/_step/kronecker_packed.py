"""A group's layers in few padded batches (``KroneckerBasis(packed=True)``).

:class:`PackedLayers` pads layer batches (:func:`~._step.kronecker_group.
layer_batches`) into one (:mod:`dampednewton.math.kronecker_packed`) once per refresh
and per damping, and keeps a zero-padded gradient buffer: a step copies every
layer's ``.grad`` into it with one multi-tensor copy and computes all directions with
one call of :func:`~dampednewton.math.kronecker.kronecker_direction`, a fixed number
of operators whatever the number and shapes of the layers. The directions are views
of the padded result. :class:`PackedGroup` splits a group into such packs, largest
layers first, so that each pack's padded gradient holds at most
:data:`PADDING_LIMIT` times its layers' own entries (one pack, unless the layers'
sizes differ by more). Steps with a noise filter or an adaptive damping, and groups
whose layers differ in dtype or device, take :func:`~._step.kronecker_group.group_step`
instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor

from dampednewton._step.cuda_graphs import ReplayedMath
from dampednewton._step.kronecker_group import KroneckerGroupStep, LayerBatch
from dampednewton._step.kronecker_state import LayerBasis
from dampednewton.math.kronecker import LayerCoefficients, kronecker_direction
from dampednewton.math.kronecker_factors import FactorEigen
from dampednewton.math.kronecker_packed import padded_coefficients, padded_eigen

PADDING_LIMIT = 4.0
"""The most entries a pack's padded gradient holds per entry of its layers' own."""


def packable(batches: Sequence[LayerBatch]) -> bool:
    """Whether the batches share a dtype and a device (one padded batch holds them)."""
    first = batches[0].output.vectors
    return all(
        batch.output.vectors.dtype == first.dtype
        and batch.output.vectors.device == first.device
        for batch in batches
    )


class PackedLayers:
    """Layer batches as one padded batch, with its gradient buffer."""

    def __init__(self, batches: Sequence[LayerBatch], graphed: bool = False) -> None:
        """Pad the batches' eigenpairs (their coefficients follow per damping).

        Args:
            batches: Layer batches of one refresh (one dtype, one device).
            graphed: Replay the math as a CUDA graph (the caller's choice, on a CUDA
                device only: :meth:`KroneckerBasis.graphs`).
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
        self._no_curvature = like.new_full((), math.nan)
        self._views: tuple[Tensor, list[tuple[Tensor, Tensor]]] | None = None
        self._graphed = graphed
        self._replayed: tuple[float, ReplayedMath[tuple[Tensor, Tensor]]] | None = None

    @property
    def replaying(self) -> bool:
        """Whether the pack's math replays a recorded CUDA graph."""
        return self._replayed is not None and self._replayed[1].replaying

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
        self.gradient()
        coefficients = self.coefficients(damping)
        if self._graphed:
            if self._replayed is None or self._replayed[0] != damping:
                math_of_buffers = partial(
                    packed_math, self._gradient, self.output, self.inputs, coefficients
                )
                replayed = ReplayedMath(math_of_buffers, self._gradient.device)
                self._replayed = (damping, replayed)
            direction, slope = self._replayed[1]()
        else:
            direction, slope = packed_math(
                self._gradient, self.output, self.inputs, coefficients
            )
        return KroneckerGroupStep(self._split(direction), slope, self._no_curvature)

    def _split(self, direction: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each parameter with its view of the padded directions (kept for replays)."""
        if self._views is not None and self._views[0] is direction:
            return self._views[1]
        views = []
        for index, basis in enumerate(self.layers):
            rows, columns = _block(basis)
            views += basis.split(direction[index, :rows, :columns])
        if self.replaying:  # a replay writes into the same tensor
            self._views = (direction, views)
        return views


def packed_math(
    gradient: Tensor,
    output: FactorEigen,
    inputs: FactorEigen,
    coefficients: LayerCoefficients,
) -> tuple[Tensor, Tensor]:
    """A pack's padded directions ``[L, O, I]`` and its slope (0-dim)."""
    layer = kronecker_direction(
        gradient, output, inputs, coefficients, with_curvature=False
    )
    return layer.direction, layer.slope.sum()


def _block(layer: LayerBasis) -> tuple[int, int]:
    """``(d_out, d_in (+1))`` of a layer's gradient matrix."""
    if layer.weight is None:
        assert layer.bias is not None
        return layer.bias.shape[0], 1
    columns = math.prod(layer.weight.shape[1:]) + (1 if layer.bias is not None else 0)
    return layer.weight.shape[0], columns


class PackedGroup:
    """A group's layer batches in packs of bounded padding (:data:`PADDING_LIMIT`)."""

    def __init__(self, batches: Sequence[LayerBatch], graphed: bool = False) -> None:
        """Split the batches into packs, largest layers first.

        Args:
            batches: The group's layer batches of one refresh (one dtype, one device).
            graphed: Replay each pack's math as a CUDA graph (on a CUDA device only).
        """
        self.batches = tuple(batches)
        self.graphed = graphed
        self.packs = [
            PackedLayers(members, graphed) for members in padded_packs(batches)
        ]

    def holds(self, batches: Sequence[LayerBatch], graphed: bool) -> bool:
        """Whether these are the batches this group was packed from, as asked."""
        return (
            graphed == self.graphed
            and len(batches) == len(self.batches)
            and all(
                mine is theirs
                for mine, theirs in zip(self.batches, batches, strict=True)
            )
        )

    def step(self, damping: float) -> KroneckerGroupStep:
        """The group's directions and slope (its curvature is left out: NaN).

        Args:
            damping: ``δ``.

        Returns:
            The step, its directions views of the packs' padded results.
        """
        steps = [pack.step(damping) for pack in self.packs]
        if len(steps) == 1:
            return steps[0]
        slope = torch.stack([step.slope for step in steps]).sum()
        directions = [pair for step in steps for pair in step.directions]
        return KroneckerGroupStep(directions, slope, steps[0].curvature)


def padded_packs(
    batches: Sequence[LayerBatch], limit: float = PADDING_LIMIT
) -> list[list[LayerBatch]]:
    """The batches in packs whose padding stays within ``limit``, largest first.

    A batch joins the current pack while the pack's padded entries (its layers
    times its largest rows times its largest columns) stay within ``limit`` times
    the entries its layers hold; otherwise it starts the next pack.

    Args:
        batches: Layer batches.
        limit: The most padded entries per own entry (``≥ 1``).

    Returns:
        The packs, each a list of batches.
    """
    sizes = {id(batch): _batch_shape(batch) for batch in batches}

    def own(members: list[LayerBatch]) -> int:
        return sum(math.prod(sizes[id(batch)]) for batch in members)

    def padded(members: list[LayerBatch]) -> int:
        count = sum(sizes[id(batch)][0] for batch in members)
        rows = max(sizes[id(batch)][1] for batch in members)
        columns = max(sizes[id(batch)][2] for batch in members)
        return count * rows * columns

    order = sorted(batches, key=lambda batch: math.prod(sizes[id(batch)][1:]))
    packs: list[list[LayerBatch]] = []
    current: list[LayerBatch] = []
    for batch in reversed(order):
        trial = [*current, batch]
        if current and padded(trial) > limit * own(trial):
            packs.append(current)
            trial = [batch]
        current = trial
    packs.append(current)
    return packs


def _batch_shape(batch: LayerBatch) -> tuple[int, int, int]:
    """``(layers, d_out, d_in (+1))`` of a batch's gradient matrices."""
    rows, columns = _block(batch.layers[0])
    return len(batch.layers), rows, columns
