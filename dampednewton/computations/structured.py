"""BackPACK module extensions that keep ``nn.Linear``'s Kronecker structure.

Instead of materializing ``[C, N, d_out, d_in]`` square roots and ``[N, d_out, d_in]``
per-sample gradients, the linear layer's square-root extension stores a
:class:`~dampednewton.factors.LinearFactor` (back-propagated square root, layer input,
output gradients) and its individual-gradient extension stores nothing. Layers with
weight sharing (inputs with more than two dimensions) fall back to BackPACK's dense
computation.
"""

from __future__ import annotations

import math

from backpack.extensions.firstorder.batch_grad.linear import BatchGradLinear
from backpack.extensions.secondorder.sqrt_ggn.linear import SqrtGGNLinear
from backpack.utils.subsampling import subsample
from torch import Tensor
from torch.nn import Module

from dampednewton.factors import DenseFactor, LinearFactor, flatten_sqrt_ggn, memo


def _is_structured(module: Module) -> bool:
    return module.input0.dim() == 2


class StructuredSqrtGGNLinear(SqrtGGNLinear):
    """Square-root extension for ``nn.Linear`` storing a :class:`LinearFactor`."""

    def weight(self, ext, module, g_inp, g_out, backproped) -> LinearFactor | Tensor:
        """Return the weight's factor (dense for inputs with weight sharing)."""
        if not _is_structured(module):
            return self._make_param_function("weight")(
                ext, module, g_inp, g_out, backproped
            )
        inputs = subsample(module.input0, subsampling=ext.get_subsampling())
        return LinearFactor(backproped, inputs, g_out[0], module.input0)

    def bias(self, ext, module, g_inp, g_out, backproped) -> LinearFactor | Tensor:
        """Return the bias's factor (dense for inputs with weight sharing)."""
        if not _is_structured(module):
            return self._make_param_function("bias")(
                ext, module, g_inp, g_out, backproped
            )
        return LinearFactor(backproped, None, g_out[0], None)


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
    sqrt_ggn: Tensor | LinearFactor,
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
    those of ``ℓ_n``.

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
    if isinstance(sqrt_ggn, LinearFactor):
        scale = math.sqrt(batch_size / sqrt_ggn.backproped.shape[1])
        backproped = memo(
            shared, ("B", id(sqrt_ggn.backproped)), lambda: sqrt_ggn.backproped * scale
        )
        output_gradients = gradient_inputs = None
        if with_gradients:
            output_gradients = memo(
                shared,
                ("δ", id(sqrt_ggn.output_gradients)),
                lambda: (
                    subsample(sqrt_ggn.output_gradients, subsampling=subsampling_grad)
                    * batch_size
                ),
            )
            if sqrt_ggn.gradient_inputs is not None:
                gradient_inputs = subsample(
                    sqrt_ggn.gradient_inputs, subsampling=subsampling_grad
                )
        return LinearFactor(
            backproped, sqrt_ggn.inputs, output_gradients, gradient_inputs
        )
    scale = math.sqrt(batch_size / sqrt_ggn.shape[1])
    gradients = grad_batch.flatten(start_dim=1) * batch_size if with_gradients else None
    return DenseFactor(
        flatten_sqrt_ggn(sqrt_ggn) * scale, sqrt_ggn.shape[2:], gradients
    )
