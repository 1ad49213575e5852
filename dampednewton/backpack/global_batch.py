"""The global batch's buffers of a layer from a rank's buffers of its local batch.

Every rank's local batch has ``N`` samples, the global one ``R·N`` (the ranks'
batches concatenated in rank order). BackPACK's square roots of the local mean loss
carry ``1/√N`` and its output and individual gradients ``1/N``; rescaled by ``1/√R``
and ``1/R`` and concatenated along the samples, they are those of the global batch's
mean loss, which the single-process assembly then reduces unchanged (batch size
``R·N``, every gathered gradient sample used).

Per structured layer, :func:`~dampednewton.math.traffic.cheaper_route` picks from
the shapes alone (so identically on every rank) whether to gather the buffers or the
materialized square root. Sub-sampling indices are local: each rank contributes
those samples of its batch, and only they are gathered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from backpack.utils.subsampling import subsample
from torch import Tensor

from dampednewton.backpack.buffers import Buffers, SharedLinearBuffers
from dampednewton.math.traffic import LinearLayerShapes, Route, cheaper_route

SampleGather = Callable[[Tensor, int], Tensor]
"""Concatenates every rank's tensor along a sample dimension (rank order)."""


@dataclass(frozen=True)
class Stored:
    """What the extensions stored on one parameter: square root and gradients.

    Attributes:
        sqrt_ggn: BackPACK's ``[C, N, …]`` square root or structured buffers.
        grad_batch: BackPACK's individual gradients, or ``None``.
    """

    sqrt_ggn: Tensor | Buffers
    grad_batch: Tensor | None


class GlobalBatch:
    """Gathers the layers' buffers over the ranks.

    Attributes:
        world_size: Number of ranks ``R``.
        subsampling_grad: Local gradient samples (``None``: the whole batch).
        per_sample_gradients: Whether the step needs per-sample gradients.
    """

    def __init__(
        self,
        gather: SampleGather,
        world_size: int,
        *,
        subsampling_grad: Sequence[int] | None = None,
        per_sample_gradients: bool = False,
    ):
        """Keep the collective and what the step needs.

        Args:
            gather: Concatenates every rank's tensor along a dimension.
            world_size: Number of ranks ``R``.
            subsampling_grad: See the attribute.
            per_sample_gradients: See the attribute.
        """
        self._gather = gather
        self.world_size = world_size
        self.subsampling_grad = subsampling_grad
        self.per_sample_gradients = per_sample_gradients
        self._memo: dict[tuple[int, float, bool], Tensor] = {}

    def layer(self, stored: Sequence[Stored]) -> list[Stored]:
        """The global batch's square roots and gradients of one layer's parameters.

        Tensors shared by the parameters of the layer are gathered once.

        Args:
            stored: What the extensions stored on the layer's parameters.

        Returns:
            Their global counterparts, in the same order.
        """
        self._memo = {}
        route = self.route(stored)
        try:
            return [self._global(entry, route) for entry in stored]
        finally:
            self._memo = {}

    def route(self, stored: Sequence[Stored]) -> Route:
        """How the layer's weight is gathered (buffers of a bias: always factors).

        Args:
            stored: What the extensions stored on the layer's parameters.

        Returns:
            The route moving fewer bytes.
        """
        shapes = self.shapes(stored)
        return Route.FACTORS if shapes is None else cheaper_route(shapes)

    def shapes(self, stored: Sequence[Stored]) -> LinearLayerShapes | None:
        """The shapes of a structured layer's buffers (``None``: no weight buffers).

        Args:
            stored: What the extensions stored on the layer's parameters.

        Returns:
            The shapes for :mod:`~dampednewton.math.traffic`.
        """
        buffers = [e.sqrt_ggn for e in stored if not isinstance(e.sqrt_ggn, Tensor)]
        weight = next((b for b in buffers if _is_weight(b)), None)
        if weight is None:
            return None
        backproped, inputs = weight.backproped, weight.inputs
        assert inputs is not None  # a weight's buffers
        shared = isinstance(weight, SharedLinearBuffers)
        return LinearLayerShapes(
            num_outputs=backproped.shape[0],
            num_samples=backproped.shape[1],
            gradient_samples=weight.output_gradients.shape[0]
            if self.subsampling_grad is None
            else len(self.subsampling_grad),
            positions=backproped.shape[2] if shared else None,
            in_features=inputs.shape[-1],
            out_features=backproped.shape[-1],
            bias=len(buffers) > 1,
            subsampled=weight.layer_inputs is not inputs or bool(self.subsampling_grad),
            per_sample_gradients=self.per_sample_gradients,
        )

    def _global(self, entry: Stored, route: Route) -> Stored:
        root = 1 / math.sqrt(self.world_size)
        sqrt_ggn = entry.sqrt_ggn
        if isinstance(sqrt_ggn, Tensor):
            return Stored(self._gathered(sqrt_ggn, 1, root), self._gradients(entry))
        if route is Route.SQRT_GGN and _is_weight(sqrt_ggn):
            gradients = (
                self._gather(
                    sqrt_ggn.individual_gradients(self.subsampling_grad)
                    / self.world_size,
                    0,
                )
                if self.per_sample_gradients
                else None
            )
            return Stored(self._gather(sqrt_ggn.sqrt_ggn() * root, 1), gradients)
        return Stored(self._buffers(sqrt_ggn, root), None)

    def _buffers(self, buffers: Buffers, root: float) -> Buffers:
        backproped = self._gathered(buffers.backproped, 1, root)
        output_gradients = self._gathered(
            buffers.output_gradients, 0, 1 / self.world_size, subsampled=True
        )
        if isinstance(buffers, SharedLinearBuffers):
            return replace(
                buffers,
                backproped=backproped,
                inputs=self._gathered(buffers.inputs, 0, 1.0),
                output_gradients=output_gradients,
                layer_inputs=self._gathered(
                    buffers.layer_inputs, 0, 1.0, subsampled=True
                ),
            )
        return replace(
            buffers,
            backproped=backproped,
            inputs=None
            if buffers.inputs is None
            else self._gathered(buffers.inputs, 0, 1.0),
            output_gradients=output_gradients,
            layer_inputs=None
            if buffers.layer_inputs is None
            else self._gathered(buffers.layer_inputs, 0, 1.0, subsampled=True),
        )

    def _gradients(self, entry: Stored) -> Tensor | None:
        """The global individual gradients ``∇ℓ_n/(R·N)`` (``None`` stays).

        BackPACK's individual gradients are already those of the gradient samples.
        """
        if entry.grad_batch is None:
            return None
        return self._gathered(entry.grad_batch, 0, 1 / self.world_size)

    def _gathered(
        self, tensor: Tensor, dim: int, scale: float, *, subsampled: bool = False
    ) -> Tensor:
        """Gather ``scale`` times the tensor (its gradient samples if ``subsampled``).

        The gradient samples' tensors hold the whole local batch: the rows of the
        gradient samples are taken before gathering.
        """
        subsampled = subsampled and self.subsampling_grad is not None
        key = (id(tensor), scale, subsampled)
        if key not in self._memo:
            local = (
                subsample(tensor, subsampling=self.subsampling_grad)
                if subsampled
                else tensor
            )
            self._memo[key] = self._gather(
                local if scale == 1.0 else local * scale, dim
            )
        return self._memo[key]


def _is_weight(buffers: Buffers) -> bool:
    """Whether buffers belong to a weight (a bias has no inputs)."""
    return buffers.inputs is not None
