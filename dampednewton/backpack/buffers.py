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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from backpack.utils.subsampling import subsample
from torch import Size, Tensor

from dampednewton.math.cost import mean_products_via_kernel, prefers_structured
from dampednewton.math.factors import (
    DenseFactor,
    Factor,
    LayerCache,
    Product,
    cached,
    flatten_sqrt_ggn,
    gathered,
)
from dampednewton.math.linear_factors import (
    LinearFactor,
    SharedLinearFactor,
    shared_weight_sqrt_ggn,
)
from dampednewton.math.precision import upcast


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

    def __post_init__(self) -> None:
        """Hold half-precision buffers in float32 (see ``math.precision``)."""
        self.backproped = upcast(self.backproped)
        self.inputs = None if self.inputs is None else upcast(self.inputs)
        self.output_gradients = upcast(self.output_gradients)
        self.layer_inputs = (
            None if self.layer_inputs is None else upcast(self.layer_inputs)
        )

    def sqrt_ggn(self) -> Tensor:
        """The materialized square root ``[C, N, d_out(, d_in)]``, BackPACK's layout."""
        if self.inputs is None:
            return self.backproped
        return torch.einsum("cno,ni->cnoi", self.backproped, self.inputs)

    def individual_gradients(self, subsampling: Sequence[int] | None) -> Tensor:
        """Per-sample gradients ``[N', d_out(, d_in)]`` in BackPACK's scaling.

        Args:
            subsampling: The gradient samples (``None``: the whole batch).
        """
        gradients = subsample(self.output_gradients, subsampling=subsampling)
        if self.layer_inputs is None:
            return gradients
        inputs = subsample(self.layer_inputs, subsampling=subsampling)
        return torch.einsum("no,ni->noi", gradients, inputs)

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

    def __post_init__(self) -> None:
        """Hold half-precision buffers in float32 (see ``math.precision``)."""
        self.backproped = upcast(self.backproped)
        self.inputs = upcast(self.inputs)
        self.output_gradients = upcast(self.output_gradients)
        self.layer_inputs = upcast(self.layer_inputs)

    shape: Size

    def sqrt_ggn(self) -> Tensor:
        """The materialized square root ``[C, N, *shape]``, BackPACK's layout."""
        num_outputs, num_samples = self.backproped.shape[:2]
        products = shared_weight_sqrt_ggn(self.backproped, self.inputs)
        return products.view(num_outputs, num_samples, *self.shape)

    def individual_gradients(self, subsampling: Sequence[int] | None) -> Tensor:
        """Per-sample gradients ``[N', *shape]`` in BackPACK's scaling.

        Args:
            subsampling: The gradient samples (``None``: the whole batch).
        """
        gradients = subsample(self.output_gradients, subsampling=subsampling)
        inputs = subsample(self.layer_inputs, subsampling=subsampling)
        products = torch.einsum("npo,npi->noi", gradients, inputs)
        return products.reshape(-1, *self.shape)

    def to_factor(self, assembly: Assembly, cache: LayerCache) -> Factor:
        """The rescaled factor; see :func:`make_factor`.

        Materialized (:func:`~dampednewton.math.linear_factors.shared_weight_sqrt_ggn`)
        unless :func:`~dampednewton.math.cost.prefers_structured` prefers the
        structured factor for these shapes (under data parallelism: the global
        batch's).
        """
        batch_size, subsampling_grad = assembly.batch_size, assembly.subsampling_grad
        num_outputs, num_samples, positions, out_features = self.backproped.shape
        in_features = self.inputs.shape[-1]
        if not prefers_structured(
            num_outputs, num_samples, positions, in_features, out_features
        ):
            gradients = (
                self.individual_gradients(subsampling_grad)
                if assembly.with_gradients
                else None
            )
            return dense_factor(self.sqrt_ggn(), gradients, assembly)
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
    return dense_factor(sqrt_ggn, grad_batch, assembly)


def dense_factor(
    sqrt_ggn: Tensor, grad_batch: Tensor | None, assembly: Assembly
) -> DenseFactor:
    """The rescaled factor of a materialized square root.

    Args:
        sqrt_ggn: BackPACK's square root ``[C, N, *p.shape]``.
        grad_batch: BackPACK's individual gradients ``[N', *p.shape]`` (or ``None``).
        assembly: Batch size and whether gradients are needed.

    Returns:
        The factor.
    """
    batch_size = assembly.batch_size
    rows = flatten_sqrt_ggn(upcast(sqrt_ggn))
    if sqrt_ggn.shape[1] != batch_size:  # a sub-sample: its own mean, see the module
        rows = rows * math.sqrt(batch_size / sqrt_ggn.shape[1])
    gradients = (
        upcast(gathered(grad_batch, "individual gradients")).flatten(start_dim=1)
        * batch_size
        if assembly.with_gradients
        else None
    )
    return DenseFactor(rows, sqrt_ggn.shape[2:], gradients)


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
