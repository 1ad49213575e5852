"""BackPACK module extensions that keep the Kronecker structure of linear layers.

Instead of materializing ``[C, N, *weight.shape]`` square roots, the square-root
extensions store what the factors of :mod:`dampednewton.factors` and
:mod:`dampednewton.shared_factors` need: back-propagated square roots, layer inputs and
output gradients.

* ``nn.Linear`` on ``[N, d_in]`` inputs: always :class:`LinearBuffers`.
* ``nn.Linear`` on ``[N, *positions, d_in]`` inputs and ``nn.Conv1d/2d/3d`` (one group,
  zero padding given by numbers) share the weight over positions: per layer,
  :func:`~dampednewton.shared_factors.prefers_structured` decides between
  :class:`SharedLinearBuffers` and BackPACK's materialized square root. Their biases
  always store :class:`LinearBuffers` of the position-summed square root.

Buffers carry the output gradients, so the individual-gradient extensions (run after
the square-root extension) skip every parameter that has them.
"""

from __future__ import annotations

from dataclasses import dataclass

from backpack.core.derivatives.conv1d import Conv1DDerivatives
from backpack.core.derivatives.conv2d import Conv2DDerivatives
from backpack.core.derivatives.conv3d import Conv3DDerivatives
from backpack.extensions.firstorder.batch_grad.conv1d import BatchGradConv1d
from backpack.extensions.firstorder.batch_grad.conv2d import BatchGradConv2d
from backpack.extensions.firstorder.batch_grad.conv3d import BatchGradConv3d
from backpack.extensions.firstorder.batch_grad.linear import BatchGradLinear
from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule
from backpack.extensions.secondorder.sqrt_ggn.linear import SqrtGGNLinear
from backpack.utils.conv import unfold_input
from backpack.utils.subsampling import subsample
from torch import Size, Tensor
from torch.nn import Conv1d, Conv2d, Conv3d, Linear, Module

from dampednewton.shared_factors import prefers_structured


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


def _shared_or_dense(extension, ext, module, g_inp, g_out, backproped, *, layout):
    """Shared-weight buffers when the cost model prefers them, else BackPACK's.

    ``layout`` maps ``[C, N, <layer's output layout>]`` to ``[C, N, P, d_out]``.
    """
    outputs_last = layout(backproped)
    num_outputs, num_samples, positions, out_features = outputs_last.shape
    in_features = module.weight[0].numel()  # d_in (times the kernel size)
    if prefers_structured(
        num_outputs, num_samples, positions, in_features, out_features
    ):
        inputs = (
            module.input0.flatten(start_dim=1, end_dim=-2)
            if isinstance(module, Linear)
            else unfold_input(module, module.input0).transpose(1, 2)
        )  # [N, P, d_in]
        return SharedLinearBuffers(
            outputs_last,
            subsample(inputs, subsampling=ext.get_subsampling()),
            layout(g_out[0].unsqueeze(0))[0],
            inputs,
            module.weight.shape,
        )
    return extension._make_param_function("weight")(
        ext, module, g_inp, g_out, backproped
    )


def _summed_over_positions(
    backproped: Tensor, g_out: tuple[Tensor], *, layout
) -> LinearBuffers:
    """A shared weight's bias: its column is ``Σ_p b_cnp``."""
    summed = layout(backproped).sum(2)
    gradients = layout(g_out[0].unsqueeze(0))[0].sum(1)
    return LinearBuffers(summed, None, gradients)


def _positions_last(tensor: Tensor) -> Tensor:
    """Channels-last ``[C, N, P, d]`` from a linear layer's ``[C, N, *P, d]``."""
    return tensor.flatten(start_dim=2, end_dim=-2)


def _channels_last(tensor: Tensor) -> Tensor:
    """``[C, N, P, d]`` from a convolution's ``[C, N, d, *spatial]``."""
    return tensor.flatten(start_dim=3).transpose(2, 3)


class StructuredSqrtGGNLinear(SqrtGGNLinear):
    """Square-root extension for ``nn.Linear`` storing (shared) linear buffers."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        """Return the weight's buffers, or BackPACK's dense square root."""
        if module.input0.dim() == 2:
            inputs = subsample(module.input0, subsampling=ext.get_subsampling())
            return LinearBuffers(backproped, inputs, g_out[0], module.input0)
        return _shared_or_dense(
            self, ext, module, g_inp, g_out, backproped, layout=_positions_last
        )

    def bias(self, ext, module, g_inp, g_out, backproped) -> LinearBuffers:
        """Return the bias's buffers."""
        if module.input0.dim() == 2:
            return LinearBuffers(backproped, None, g_out[0])
        return _summed_over_positions(backproped, g_out, layout=_positions_last)


class StructuredSqrtGGNConv(SqrtGGNBaseModule):
    """Square-root extension for ``nn.Conv1d/2d/3d`` deciding per layer."""

    def __init__(self, module_class: type[Conv1d | Conv2d | Conv3d]):
        """Use BackPACK's derivatives of the convolution's dimension.

        Args:
            module_class: ``nn.Conv1d``, ``nn.Conv2d`` or ``nn.Conv3d``.
        """
        derivatives = {
            Conv1d: Conv1DDerivatives,
            Conv2d: Conv2DDerivatives,
            Conv3d: Conv3DDerivatives,
        }[module_class]()
        super().__init__(derivatives, params=["bias", "weight"])

    def weight(self, ext, module, g_inp, g_out, backproped):
        """Return shared-weight buffers, or BackPACK's dense square root."""
        if not _unfoldable(module):
            return self._make_param_function("weight")(
                ext, module, g_inp, g_out, backproped
            )
        return _shared_or_dense(
            self, ext, module, g_inp, g_out, backproped, layout=_channels_last
        )

    def bias(self, ext, module, g_inp, g_out, backproped) -> LinearBuffers:
        """Return the bias's buffers (the square root summed over positions)."""
        return _summed_over_positions(backproped, g_out, layout=_channels_last)


def _unfoldable(module: Module) -> bool:
    return (
        module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def _carries_gradients(param: Tensor) -> bool:
    """Whether the square-root extension (run first) left buffers with gradients."""
    return any(
        isinstance(getattr(param, savefield, None), LinearBuffers | SharedLinearBuffers)
        for savefield in ("sqrt_ggn_exact", "sqrt_ggn_mc")
    )


def _gradients_unless_carried(name: str):
    def individual_gradients(self, ext, module, g_inp, g_out, bp_quantities):
        if _carries_gradients(getattr(module, name)):
            return None
        return self._make_param_function(name)(ext, module, g_inp, g_out, bp_quantities)

    individual_gradients.__doc__ = (
        f"Return the {name}'s individual gradients, or ``None`` when the square-root "
        "buffers carry them."
    )
    return individual_gradients


def _skipping_carried(base: type) -> type:
    """Subclass of a BackPACK individual-gradient extension that skips carried ones."""
    return type(
        f"Structured{base.__name__}",
        (base,),
        {
            "__doc__": f"{base.__name__} that skips parameters whose buffers carry "
            "the gradients.",
            "weight": _gradients_unless_carried("weight"),
            "bias": _gradients_unless_carried("bias"),
        },
    )


STRUCTURED_BATCH_GRAD: dict[type[Module], type] = {
    Linear: _skipping_carried(BatchGradLinear),
    Conv1d: _skipping_carried(BatchGradConv1d),
    Conv2d: _skipping_carried(BatchGradConv2d),
    Conv3d: _skipping_carried(BatchGradConv3d),
}
"""Individual-gradient module extensions to register next to the structured ones."""
