"""BackPACK module extensions that keep ``nn.Linear``'s Kronecker structure.

Instead of materializing ``[C, N, d_out, d_in]`` square roots and ``[N, d_out, d_in]``
per-sample gradients, the linear layer's square-root extension stores
:class:`LinearBuffers` (back-propagated square root, layer inputs, output gradients),
from which :func:`make_factor` builds a :class:`~dampednewton.factors.LinearFactor`,
and its individual-gradient extension stores nothing. Layers with
weight sharing (inputs with more than two dimensions) fall back to BackPACK's dense
computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backpack.extensions.firstorder.batch_grad.linear import BatchGradLinear
from backpack.extensions.secondorder.sqrt_ggn.linear import SqrtGGNLinear
from backpack.utils.subsampling import subsample
from torch import Tensor
from torch.nn import Module

from dampednewton.factors import (
    DenseFactor,
    LinearFactor,
    flatten_sqrt_ggn,
    mean_products_via_kernel,
    memo,
)


@dataclass
class LinearBuffers:
    """What the structured square-root extension stores on a linear parameter.

    Attributes:
        backproped: Back-propagated square root at the layer output ``[C, N, d_out]``.
        inputs: Layer inputs of the GGN samples ``[N, d_in]``; ``None`` for the bias.
        output_gradients: Output gradients of the mean loss for the whole batch.
        layer_inputs: Layer inputs of the whole batch (for weight and bias).
    """

    backproped: Tensor
    inputs: Tensor | None
    output_gradients: Tensor
    layer_inputs: Tensor


def _is_structured(module: Module) -> bool:
    return module.input0.dim() == 2


class StructuredSqrtGGNLinear(SqrtGGNLinear):
    """Square-root extension for ``nn.Linear`` storing :class:`LinearBuffers`."""

    def weight(self, ext, module, g_inp, g_out, backproped) -> LinearBuffers | Tensor:
        """Return the weight's buffers (dense square root for weight sharing)."""
        if not _is_structured(module):
            return self._make_param_function("weight")(
                ext, module, g_inp, g_out, backproped
            )
        inputs = subsample(module.input0, subsampling=ext.get_subsampling())
        return LinearBuffers(backproped, inputs, g_out[0], module.input0)

    def bias(self, ext, module, g_inp, g_out, backproped) -> LinearBuffers | Tensor:
        """Return the bias's buffers (dense square root for weight sharing)."""
        if not _is_structured(module):
            return self._make_param_function("bias")(
                ext, module, g_inp, g_out, backproped
            )
        return LinearBuffers(backproped, None, g_out[0], module.input0)


class StructuredBatchGradLinear(BatchGradLinear):
    """Individual gradients for ``nn.Linear``: none when the factor carries them."""

    def weight(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor | None:
        """Skip the ``[N, d_out, d_in]`` tensor; dense for weight sharing."""
        if _is_structured(module):
            return None
        return self._make_param_function("weight")(
            ext, module, g_inp, g_out, bp_quantities
        )

    def bias(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor | None:
        """Skip the ``[N, d_out]`` tensor; dense for weight sharing."""
        if _is_structured(module):
            return None
        return self._make_param_function("bias")(
            ext, module, g_inp, g_out, bp_quantities
        )


def make_factor(
    sqrt_ggn: Tensor | LinearBuffers,
    grad_batch: Tensor | None,
    *,
    batch_size: int,
    subsampling_grad: list[int] | None,
    with_gradients: bool,
    shared: dict,
) -> DenseFactor | LinearFactor:
    """Turn BackPACK's buffers of one parameter into a rescaled factor.

    BackPACK scales square roots by ``1/√N`` for the whole batch, whereas a
    sub-sample's GGN is its own mean: the factor is rescaled by ``√(N/N_ggn)``.
    Gradients are rescaled from ``∇ℓ_n/N`` (or output gradients of the mean loss) to
    those of ``ℓ_n``. A linear factor keeps output gradients and input kernel when
    per-sample gradients are needed, or when they are the cheaper route to the mean
    gradient's products (:func:`~dampednewton.factors.mean_products_via_kernel`).

    Args:
        sqrt_ggn: What the square-root extension stored on the parameter.
        grad_batch: What the individual-gradient extension stored (or ``None``).
        batch_size: ``N``, the mini-batch size.
        subsampling_grad: Samples of the gradients (``None``: all).
        with_gradients: Whether per-sample gradients are needed.
        shared: Memo for the parameters of one layer, so that its weight and bias
            factors share the rescaled tensors (and, later, their products).

    Returns:
        The parameter's factor in the conventions of :mod:`dampednewton.factors`.
    """
    if isinstance(sqrt_ggn, LinearBuffers):
        return _linear_factor(
            sqrt_ggn, batch_size, subsampling_grad, with_gradients, shared
        )
    scale = math.sqrt(batch_size / sqrt_ggn.shape[1])
    gradients = grad_batch.flatten(start_dim=1) * batch_size if with_gradients else None
    return DenseFactor(
        flatten_sqrt_ggn(sqrt_ggn) * scale, sqrt_ggn.shape[2:], gradients
    )


def _linear_factor(
    buffers: LinearBuffers,
    batch_size: int,
    subsampling_grad: list[int] | None,
    with_gradients: bool,
    shared: dict,
) -> LinearFactor:
    num_outputs, num_samples, out_features = buffers.backproped.shape
    backproped = buffers.backproped
    if num_samples != batch_size:
        scale = math.sqrt(batch_size / num_samples)
        backproped = memo(shared, ("B", id(backproped)), lambda: backproped * scale)
    gradient_inputs = subsample(buffers.layer_inputs, subsampling=subsampling_grad)
    kernel_shared = gradient_inputs is buffers.inputs  # no subsampling at all
    keeps_gradients = with_gradients or mean_products_via_kernel(
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
