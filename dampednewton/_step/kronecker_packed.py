"""A group's layers in few padded batches (``KroneckerBasis(packed=True)``).

:class:`PackedLayers` pads layer batches (:func:`~._step.kronecker_group.
layer_batches`) into one (:mod:`dampednewton.math.kronecker_packed`) and keeps it in
buffers of its own, with a zero-padded gradient buffer: a refresh that keeps the
layers' shapes copies its eigenpairs into them and a new damping its coefficients
(a recorded CUDA graph of the math reads the buffers: it is recorded once, not once
per refresh; a failed step's refill is undone by the next step's, which copies the
restored eigenpairs back). A step copies every
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
from dataclasses import fields
from functools import partial

import torch
from torch import Tensor

from dampednewton._step.cuda_graphs import ReplayedMath
from dampednewton._step.kronecker_group import KroneckerGroupStep, LayerBatch
from dampednewton._step.kronecker_state import LayerBasis
from dampednewton.math.kronecker import kronecker_direction
from dampednewton.math.kronecker_coefficients import LayerCoefficients
from dampednewton.math.kronecker_factors import FactorEigen
from dampednewton.math.kronecker_packed import (
    batched_fields,
    block_views,
    padded_coefficients,
    padded_eigen,
    padding_masks,
)

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
    """Layer batches as one padded batch, in buffers that outlive refreshes.

    The padded eigenpairs, coefficients and gradient are buffers the pack owns: a
    refresh whose layers keep their shapes copies its eigenpairs into them
    (:meth:`refill`), and a new damping its coefficients, so a recorded CUDA graph of
    the math (which reads these buffers) is recorded once and replayed for the run.
    """

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
        outputs = [batch.output for batch in batches]
        inputs = [batch.inputs for batch in batches]
        self.output, self.inputs = padded_eigen(outputs), padded_eigen(inputs)
        # Where a refill copies each batch's eigenpairs (the layout stays).
        self._blocks = block_views(self.output, outputs) + block_views(
            self.inputs, inputs
        )
        like = self.output.vectors
        self._masks = padding_masks(_layer_shapes(outputs), _layer_shapes(inputs), like)
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
        self._coefficients: LayerCoefficients | None = None
        self._damping: float | None = None
        self._no_curvature = like.new_full((), math.nan)
        self._views: tuple[Tensor, list[tuple[Tensor, Tensor]]] | None = None
        self._graphed = graphed
        self._replayed: ReplayedMath[tuple[Tensor, Tensor]] | None = None

    @property
    def replaying(self) -> bool:
        """Whether the pack's math replays a recorded CUDA graph."""
        return self._replayed is not None and self._replayed.replaying

    def fits(self, batches: Sequence[LayerBatch]) -> bool:
        """Whether a refresh's batches hold this pack's layers in its shapes."""
        return len(batches) == len(self.batches) and all(
            _same_layers(mine, theirs)
            for mine, theirs in zip(self.batches, batches, strict=True)
        )

    def refill(self, batches: Sequence[LayerBatch]) -> None:
        """Copy the eigenpairs of batches that :meth:`fits` into the buffers.

        One multi-tensor copy; the coefficients follow at the next step.
        """
        if all(
            mine is theirs for mine, theirs in zip(self.batches, batches, strict=True)
        ):
            return
        sources = batched_fields([batch.output for batch in batches])
        sources += batched_fields([batch.inputs for batch in batches])
        torch._foreach_copy_(self._blocks, sources)
        self.batches = tuple(batches)
        self._damping = None

    def coefficients(self, damping: float) -> LayerCoefficients:
        """The layers' padded coefficients for ``δ = damping`` (kept while it holds)."""
        if self._coefficients is not None and self._damping == damping:
            return self._coefficients
        padded = padded_coefficients(self.output, self.inputs, damping, self._masks)
        if self._coefficients is None:
            self._coefficients = padded
        else:  # into the tensors a recorded graph reads
            targets, sources = [], []
            for name in _COEFFICIENT_FIELDS:
                target, source = (
                    getattr(self._coefficients, name),
                    getattr(padded, name),
                )
                if target is not None and source is not None:
                    targets.append(target)
                    sources.append(source)
            torch._foreach_copy_(targets, sources)
        self._damping = damping
        return self._coefficients

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
            if self._replayed is None:
                math_of_buffers = partial(
                    packed_math, self._gradient, self.output, self.inputs, coefficients
                )
                self._replayed = ReplayedMath(math_of_buffers, self._gradient.device)
            direction, slope = self._replayed()
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


_COEFFICIENT_FIELDS = tuple(field.name for field in fields(LayerCoefficients))


def _layer_shapes(eigen: Sequence[FactorEigen]) -> list[tuple[int, int]]:
    """Each layer's ``(dimension, kept rank)`` of batches' eigenpairs of one side."""
    return [
        (each.vectors.shape[-2], each.vectors.shape[-1])
        for each in eigen
        for _ in range(each.vectors.shape[0] if each.vectors.dim() > 2 else 1)
    ]


def _same_layers(mine: LayerBatch, theirs: LayerBatch) -> bool:
    """Whether two batches hold the same parameters in eigenpairs of equal layouts.

    Equal shapes, dtypes and devices: a refill copies one into the other's buffers.
    """

    def layout(tensor: Tensor) -> tuple:
        return tensor.shape, tensor.dtype, tensor.device

    return (
        len(mine.layers) == len(theirs.layers)
        and all(
            a.weight is b.weight and a.bias is b.bias
            for a, b in zip(mine.layers, theirs.layers, strict=True)
        )
        and all(
            layout(getattr(mine_side, name)) == layout(getattr(their_side, name))
            for mine_side, their_side in (
                (mine.output, theirs.output),
                (mine.inputs, theirs.inputs),
            )
            for name in ("values", "vectors")
        )
    )


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

    def refill(self, batches: Sequence[LayerBatch], graphed: bool) -> bool:
        """Take a refresh's batches into the packs' buffers, if they fit them.

        Returns:
            Whether the packs hold the batches now; ``False`` (nothing changed): the
            layers or their shapes differ, or ``graphed`` does; build a new group.
        """
        if graphed != self.graphed or len(batches) != len(self.batches):
            return False
        if all(
            mine is theirs for mine, theirs in zip(self.batches, batches, strict=True)
        ):
            return True  # a step between refreshes
        members = padded_packs(batches)
        if len(members) != len(self.packs) or not all(
            pack.fits(batches_of_pack)
            for pack, batches_of_pack in zip(self.packs, members, strict=True)
        ):
            return False
        for pack, batches_of_pack in zip(self.packs, members, strict=True):
            pack.refill(batches_of_pack)
        self.batches = tuple(batches)
        return True

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
