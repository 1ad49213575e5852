"""Assembly of a parameter's factor from what BackPACK's extensions stored on it."""

from __future__ import annotations

import math

from backpack.utils.subsampling import subsample
from torch import Tensor

from dampednewton.computations.structured import LinearBuffers, SharedLinearBuffers
from dampednewton.factors import (
    DenseFactor,
    LinearFactor,
    flatten_sqrt_ggn,
    mean_products_via_kernel,
    memo,
)
from dampednewton.shared_factors import SharedLinearFactor

Factor = DenseFactor | LinearFactor | SharedLinearFactor


def make_factor(
    sqrt_ggn: Tensor | LinearBuffers | SharedLinearBuffers,
    grad_batch: Tensor | None,
    *,
    batch_size: int,
    subsampling_grad: list[int] | None,
    with_gradients: bool,
    shared: dict,
) -> Factor:
    """Turn BackPACK's buffers of one parameter into a rescaled factor.

    BackPACK scales square roots by ``1/√N`` for the whole batch, whereas a
    sub-sample's GGN is its own mean: the factor is rescaled by ``√(N/N_ggn)``.
    Gradients are rescaled from ``∇ℓ_n/N`` (or output gradients of the mean loss) to
    those of ``ℓ_n``. A linear weight's factor keeps output gradients and input kernel
    when per-sample gradients are needed, or when they are the cheaper route to the
    mean gradient's products (:func:`~dampednewton.factors.mean_products_via_kernel`).

    Args:
        sqrt_ggn: What the square-root extension stored on the parameter.
        grad_batch: What the individual-gradient extension stored (or ``None``).
        batch_size: ``N``, the mini-batch size.
        subsampling_grad: Samples of the gradients (``None``: all).
        with_gradients: Whether per-sample gradients are needed.
        shared: Memo for the parameters of one layer, so that its weight and bias
            factors share the rescaled tensors (and, later, their products).

    Returns:
        The parameter's factor.
    """
    if isinstance(sqrt_ggn, LinearBuffers):
        return _linear_factor(
            sqrt_ggn, batch_size, subsampling_grad, with_gradients, shared
        )
    if isinstance(sqrt_ggn, SharedLinearBuffers):
        return _shared_linear_factor(
            sqrt_ggn, batch_size, subsampling_grad, with_gradients
        )
    scale = math.sqrt(batch_size / sqrt_ggn.shape[1])
    gradients = grad_batch.flatten(start_dim=1) * batch_size if with_gradients else None
    return DenseFactor(
        flatten_sqrt_ggn(sqrt_ggn) * scale, sqrt_ggn.shape[2:], gradients
    )


def _rescaled(backproped: Tensor, batch_size: int, shared: dict | None) -> Tensor:
    """Square root of the GGN samples' own mean: ``√(N/N_ggn)`` times BackPACK's."""
    num_samples = backproped.shape[1]
    if num_samples == batch_size:
        return backproped
    scale = math.sqrt(batch_size / num_samples)
    return memo(shared, ("B", id(backproped)), lambda: backproped * scale)


def _linear_factor(
    buffers: LinearBuffers,
    batch_size: int,
    subsampling_grad: list[int] | None,
    with_gradients: bool,
    shared: dict,
) -> LinearFactor:
    backproped = _rescaled(buffers.backproped, batch_size, shared)
    num_outputs, num_samples, out_features = backproped.shape
    keeps_gradients = with_gradients
    if buffers.inputs is not None:
        gradient_inputs = subsample(buffers.layer_inputs, subsampling=subsampling_grad)
        kernel_shared = gradient_inputs is buffers.inputs  # no subsampling at all
        keeps_gradients = keeps_gradients or mean_products_via_kernel(
            num_outputs,
            num_samples,
            gradient_inputs.shape[0],
            gradient_inputs.shape[1],
            out_features,
            kernel_shared=kernel_shared,
        )
    if not keeps_gradients:
        return LinearFactor(backproped, buffers.inputs)
    output_gradients = memo(
        shared,
        ("δ", id(buffers.output_gradients)),
        lambda: (
            subsample(buffers.output_gradients, subsampling=subsampling_grad)
            * batch_size
        ),
    )
    kernel = None
    if buffers.inputs is not None:
        # Under the Gram matrix's key when the samples agree, so it is formed once.
        key = ("XXᵀ", id(buffers.inputs))
        if not kernel_shared:
            key = ("X'Xᵀ", id(gradient_inputs), id(buffers.inputs))
        kernel = memo(shared, key, lambda: gradient_inputs @ buffers.inputs.T)
    return LinearFactor(backproped, buffers.inputs, output_gradients, kernel)


def _shared_linear_factor(
    buffers: SharedLinearBuffers,
    batch_size: int,
    subsampling_grad: list[int] | None,
    with_gradients: bool,
) -> SharedLinearFactor:
    factor = SharedLinearFactor(
        _rescaled(buffers.backproped, batch_size, None), buffers.inputs, buffers.shape
    )
    if with_gradients:
        factor.output_gradients = (
            subsample(buffers.output_gradients, subsampling=subsampling_grad)
            * batch_size
        )
        factor.gradient_inputs = subsample(
            buffers.layer_inputs, subsampling=subsampling_grad
        )
    return factor
