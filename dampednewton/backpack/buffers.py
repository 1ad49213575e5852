"""What the structured extensions store on a parameter, and the factor it becomes.

BackPACK's square-root extensions store ``[C, N, *p.shape]`` tensors; the structured
module extensions of :mod:`~dampednewton.backpack.layers` store buffers instead.
:func:`make_factor` turns either into a rescaled
:class:`~dampednewton.math.factors.Factor`.

BackPACK scales square roots by ``1/√N`` for the whole batch, whereas a sub-sample's
GGN is its own mean: factors are rescaled by ``√(N/N_ggn)``. Gradients are rescaled
from ``∇ℓ_n/N`` (or output gradients of the mean loss) to those of ``ℓ_n``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from backpack.utils.subsampling import subsample
from torch import Size, Tensor

from dampednewton.math.cost import mean_products_via_kernel
from dampednewton.math.factors import (
    DenseFactor,
    Factor,
    LayerCache,
    Product,
    cached,
    flatten_sqrt_ggn,
    gathered,
)
from dampednewton.math.linear_factors import LinearFactor, SharedLinearFactor


@dataclass(frozen=True)
class Assembly:
    """What the factors of one backward pass are assembled for.

    Attributes:
        batch_size: ``N``, the mini-batch size.
        subsampling_grad: Samples of the gradients (``None``: all).
        with_gradients: Whether per-sample gradients are needed.
    """

    batch_size: int
    subsampling_grad: Sequence[int] | None
    with_gradients: bool


@dataclass
class LinearBuffers:
    """What a structured square-root extension stores on a linear weight or bias.

    Attributes:
        backproped: Back-propagated square root at the layer output ``[C, N, d_out]``
            (summed over positions for the bias of a shared weight).
        inputs: Layer inputs of the GGN samples ``[N, d_in]``; ``None`` for a bias.
        output_gradients: Output gradients of the mean loss for the whole batch
            ``[N_batch, d_out]`` (summed over positions likewise).
        layer_inputs: Layer inputs of the whole batch; ``None`` for a bias.
    """

    backproped: Tensor
    inputs: Tensor | None
    output_gradients: Tensor
    layer_inputs: Tensor | None = None

    def to_factor(self, assembly: Assembly, cache: LayerCache) -> LinearFactor:
        """The rescaled factor; see :func:`make_factor`.

        It keeps output gradients and input kernel when per-sample gradients are
        needed, or when they are the cheaper route to the mean gradient's products
        (:func:`~dampednewton.math.cost.mean_products_via_kernel`).
        """
        batch_size, subsampling_grad = assembly.batch_size, assembly.subsampling_grad
        backproped = _rescaled(self.backproped, batch_size, cache)
        num_outputs, num_samples, out_features = backproped.shape
        keeps_gradients = assembly.with_gradients
        if self.inputs is not None:
            gradient_inputs = subsample(self.layer_inputs, subsampling=subsampling_grad)
            kernel_shared = gradient_inputs is self.inputs  # no subsampling at all
            keeps_gradients = keeps_gradients or mean_products_via_kernel(
                num_outputs,
                num_samples,
                gradient_inputs.shape[0],
                gradient_inputs.shape[1],
                out_features,
                kernel_shared=kernel_shared,
            )
        if not keeps_gradients:
            return LinearFactor(backproped, self.inputs)
        output_gradients = cache.get(
            Product.OUTPUT_GRADIENTS,
            (self.output_gradients,),
            lambda: (
                subsample(self.output_gradients, subsampling=subsampling_grad)
                * batch_size
            ),
        )
        kernel = None
        if self.inputs is not None:
            inputs = self.inputs
            # The Gram matrix's kernel when the samples agree, so it is formed once.
            if kernel_shared:
                kernel = cache.get(
                    Product.INPUT_KERNEL, (inputs,), lambda: inputs @ inputs.T
                )
            else:
                kernel = cache.get(
                    Product.CROSS_KERNEL,
                    (gradient_inputs, inputs),
                    lambda: gradient_inputs @ inputs.T,
                )
        return LinearFactor(backproped, self.inputs, output_gradients, kernel)


@dataclass
class SharedLinearBuffers:
    """What a structured square-root extension stores on a weight shared over positions.

    Attributes:
        backproped: Back-propagated square root ``[C, N, P, d_out]``.
        inputs: Inputs of the GGN samples ``[N, P, d_in]`` (unfolded for convolutions).
        output_gradients: Output gradients of the mean loss ``[N_batch, P, d_out]``.
        layer_inputs: Inputs of the whole batch ``[N_batch, P, d_in]``.
        shape: The weight's shape.
    """

    backproped: Tensor
    inputs: Tensor
    output_gradients: Tensor
    layer_inputs: Tensor
    shape: Size

    def to_factor(self, assembly: Assembly, cache: LayerCache) -> SharedLinearFactor:
        """The rescaled factor; see :func:`make_factor`."""
        batch_size, subsampling_grad = assembly.batch_size, assembly.subsampling_grad
        factor = SharedLinearFactor(
            _rescaled(self.backproped, batch_size, None), self.inputs, self.shape
        )
        if assembly.with_gradients:
            factor.output_gradients = (
                subsample(self.output_gradients, subsampling=subsampling_grad)
                * batch_size
            )
            factor.gradient_inputs = subsample(
                self.layer_inputs, subsampling=subsampling_grad
            )
        return factor


Buffers = LinearBuffers | SharedLinearBuffers
"""Everything the structured square-root extensions store."""

SampleGather = Callable[[Tensor, int], Tensor]
"""Concatenates every rank's tensor along a sample dimension (rank order)."""


class GlobalBatch:
    """Buffers of the global batch from a rank's buffers of its local batch.

    Every rank's local batch has ``N`` samples, the global one ``R·N``. BackPACK's
    square roots of the local mean loss carry ``1/√N`` and its output and individual
    gradients ``1/N``; rescaled by ``1/√R`` and ``1/R`` and concatenated along the
    samples, they are those of the global batch's mean loss, which the single-process
    assembly then reduces unchanged (with batch size ``R·N``). Tensors shared by the
    parameters of one layer are gathered once.
    """

    world_size: int

    def __init__(self, gather: SampleGather, world_size: int):
        """Keep the collective.

        Args:
            gather: Concatenates every rank's tensor along a dimension.
            world_size: Number of ranks ``R``.
        """
        self._gather = gather
        self.world_size = world_size
        self._memo: dict[tuple[int, float], Tensor] = {}

    def new_layer(self) -> None:
        """Forget the tensors of the previous layer."""
        self._memo = {}

    def sqrt_ggn(self, sqrt_ggn: Tensor | Buffers) -> Tensor | Buffers:
        """The global square root (or buffers) of what a parameter stores.

        Args:
            sqrt_ggn: BackPACK's ``[C, N, …]`` square root or structured buffers.

        Returns:
            Its global counterpart.
        """
        root = 1 / math.sqrt(self.world_size)
        if isinstance(sqrt_ggn, Tensor):
            return self._gathered(sqrt_ggn, 1, root)
        backproped = self._gathered(sqrt_ggn.backproped, 1, root)
        output_gradients = self._gathered(
            sqrt_ggn.output_gradients, 0, 1 / self.world_size
        )
        if isinstance(sqrt_ggn, SharedLinearBuffers):
            return replace(
                sqrt_ggn,
                backproped=backproped,
                inputs=self._gathered(sqrt_ggn.inputs, 0, 1.0),
                output_gradients=output_gradients,
                layer_inputs=self._gathered(sqrt_ggn.layer_inputs, 0, 1.0),
            )
        return replace(
            sqrt_ggn,
            backproped=backproped,
            inputs=self._optional(sqrt_ggn.inputs),
            output_gradients=output_gradients,
            layer_inputs=self._optional(sqrt_ggn.layer_inputs),
        )

    def gradients(self, grad_batch: Tensor | None) -> Tensor | None:
        """The global individual gradients ``∇ℓ_n/(R·N)`` (``None`` stays)."""
        if grad_batch is None:
            return None
        return self._gathered(grad_batch, 0, 1 / self.world_size)

    def _optional(self, tensor: Tensor | None) -> Tensor | None:
        return None if tensor is None else self._gathered(tensor, 0, 1.0)

    def _gathered(self, tensor: Tensor, dim: int, scale: float) -> Tensor:
        key = (id(tensor), scale)
        if key not in self._memo:
            local = tensor if scale == 1.0 else tensor * scale
            self._memo[key] = self._gather(local, dim)
        return self._memo[key]


def make_factor(
    sqrt_ggn: Tensor | Buffers,
    grad_batch: Tensor | None,
    assembly: Assembly,
    cache: LayerCache,
) -> Factor:
    """Turn BackPACK's buffers of one parameter into a rescaled factor.

    Args:
        sqrt_ggn: What the square-root extension stored on the parameter.
        grad_batch: What the individual-gradient extension stored (or ``None``).
        assembly: Batch size, gradient samples, and whether gradients are needed.
        cache: Cache of the parameter's layer, so that its weight and bias factors
            share the rescaled tensors (and, later, their products).

    Returns:
        The parameter's factor.
    """
    if isinstance(sqrt_ggn, LinearBuffers | SharedLinearBuffers):
        return sqrt_ggn.to_factor(assembly, cache)
    batch_size = assembly.batch_size
    scale = math.sqrt(batch_size / sqrt_ggn.shape[1])
    gradients = (
        gathered(grad_batch, "individual gradients").flatten(start_dim=1) * batch_size
        if assembly.with_gradients
        else None
    )
    return DenseFactor(
        flatten_sqrt_ggn(sqrt_ggn) * scale, sqrt_ggn.shape[2:], gradients
    )


def factor_size(sqrt_ggn: Tensor | Buffers) -> tuple[int, int]:
    """``C`` and ``N`` of what a square-root extension stored.

    Args:
        sqrt_ggn: BackPACK's square root ``[C, N, …]`` or structured buffers.

    Returns:
        Square-root columns per sample ``C`` and GGN samples ``N``.
    """
    tensor = sqrt_ggn if isinstance(sqrt_ggn, Tensor) else sqrt_ggn.backproped
    num_outputs, num_samples = tensor.shape[:2]
    return num_outputs, num_samples


def _rescaled(backproped: Tensor, batch_size: int, cache: LayerCache | None) -> Tensor:
    """Square root of the GGN samples' own mean: ``√(N/N_ggn)`` times BackPACK's."""
    num_samples = backproped.shape[1]
    if num_samples == batch_size:
        return backproped
    scale = math.sqrt(batch_size / num_samples)
    return cached(cache, Product.RESCALED, (backproped,), lambda: backproped * scale)
