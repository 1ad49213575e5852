"""The layers with structured square roots: the :data:`LAYERS` registry.

Instead of materializing ``[C, N, *weight.shape]`` square roots, the structured
square-root module extensions store :mod:`~dampednewton.backpack.buffers`
(back-propagated square roots, layer inputs and output gradients), which become the
factors of :mod:`dampednewton.math.linear_factors`. Adding a layer type takes one
entry in :data:`LAYERS` (and buffers and a factor, if the existing ones do not fit).

* ``nn.Linear`` on ``[N, d_in]`` inputs: always :class:`LinearBuffers`.
* ``nn.Linear`` on ``[N, *positions, d_in]`` inputs and ``nn.Conv1d/2d/3d`` (one group,
  zero padding given by numbers) share the weight over positions:
  :class:`SharedLinearBuffers`, which
  :func:`~dampednewton.math.cost.prefers_structured` turns into a structured or a
  materialized factor per layer. Their biases store :class:`LinearBuffers` of the
  position-summed square root.

Buffers carry the output gradients, so the individual-gradient extensions (run after
the square-root extension) skip every parameter that has them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from backpack.core.derivatives.conv1d import Conv1DDerivatives
from backpack.core.derivatives.conv2d import Conv2DDerivatives
from backpack.core.derivatives.conv3d import Conv3DDerivatives
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.batch_grad.conv1d import BatchGradConv1d
from backpack.extensions.firstorder.batch_grad.conv2d import BatchGradConv2d
from backpack.extensions.firstorder.batch_grad.conv3d import BatchGradConv3d
from backpack.extensions.firstorder.batch_grad.linear import BatchGradLinear
from backpack.extensions.module_extension import ModuleExtension
from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule
from backpack.extensions.secondorder.sqrt_ggn.linear import SqrtGGNLinear
from backpack.utils.subsampling import subsample
from torch import Tensor
from torch.nn import Conv1d, Conv2d, Conv3d, Linear, Module

from dampednewton.backpack.buffers import LinearBuffers, SharedLinearBuffers
from dampednewton.backpack.private import default_param_function
from dampednewton.backpack.savefields import SQRT_GGNS, module_input
from dampednewton.math.patches import conv_patches


def _shared_buffers(module, ext, g_out, backproped, *, layout) -> SharedLinearBuffers:
    """A shared weight's buffers (``layout``: ``[C, N, <output>]`` to ``[C, N, P, o]``).

    Kept even where materializing ``V`` is cheaper: the engine reduces them at once,
    and :meth:`SharedLinearBuffers.to_factor` materializes ``V`` in its own memory,
    where BackPACK's convolution route repeats the input for every column.
    """
    inputs = (
        module_input(module).flatten(start_dim=1, end_dim=-2)
        if isinstance(module, Linear)
        else conv_patches(
            module_input(module),
            module.kernel_size,
            stride=module.stride,
            padding=module.padding,
            dilation=module.dilation,
        )
    )  # [N, P, d_in]
    return SharedLinearBuffers(
        layout(backproped),
        subsample(inputs, subsampling=ext.get_subsampling()),
        layout(g_out[0].unsqueeze(0))[0],
        inputs,
        module.weight.shape,
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
        """Return the weight's buffers."""
        if module.input0.dim() == 2:
            inputs = subsample(module.input0, subsampling=ext.get_subsampling())
            return LinearBuffers(backproped, inputs, g_out[0], module.input0)
        return _shared_buffers(module, ext, g_out, backproped, layout=_positions_last)

    def bias(self, ext, module, g_inp, g_out, backproped) -> LinearBuffers:
        """Return the bias's buffers."""
        if module.input0.dim() == 2:
            return LinearBuffers(backproped, None, g_out[0])
        return _summed_over_positions(backproped, g_out, layout=_positions_last)


class StructuredSqrtGGNConv(SqrtGGNBaseModule):
    """Square-root extension for ``nn.Conv1d/2d/3d`` storing shared-weight buffers."""

    def __init__(self, derivatives: type):
        """Use BackPACK's derivatives of the convolution's dimension.

        Args:
            derivatives: BackPACK's derivatives class of the convolution, e.g.
                ``Conv2DDerivatives``.
        """
        super().__init__(derivatives(), params=["bias", "weight"])

    def weight(self, ext, module, g_inp, g_out, backproped):
        """Return shared-weight buffers, or BackPACK's square root (groups, strings)."""
        if not unfoldable(module):
            return default_param_function(self, "weight")(
                ext, module, g_inp, g_out, backproped
            )
        return _shared_buffers(module, ext, g_out, backproped, layout=_channels_last)

    def bias(self, ext, module, g_inp, g_out, backproped) -> LinearBuffers:
        """Return the bias's buffers (the square root summed over positions)."""
        return _summed_over_positions(backproped, g_out, layout=_channels_last)


def unfoldable(module: Conv1d | Conv2d | Conv3d) -> bool:
    """Whether the structured route unfolds the convolution: one group, zero padding."""
    return (
        module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def _carries_gradients(param: Tensor) -> bool:
    """Whether the square-root extension (run first) left buffers with gradients."""
    return any(
        isinstance(getattr(param, savefield, None), LinearBuffers | SharedLinearBuffers)
        for savefield in SQRT_GGNS
    )


def _gradients_unless_carried(name: str):
    def individual_gradients(self, ext, module, g_inp, g_out, bp_quantities):
        if _carries_gradients(getattr(module, name)):
            return None
        return default_param_function(self, name)(
            ext, module, g_inp, g_out, bp_quantities
        )

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


@dataclass(frozen=True)
class Layer:
    """How the structured route handles one module type.

    Attributes:
        sqrt_ggn: Makes the square-root module extension that stores buffers.
        individual_gradients: Makes the individual-gradient module extension that
            skips parameters whose buffers carry their gradients.
    """

    sqrt_ggn: Callable[[], ModuleExtension]
    individual_gradients: Callable[[], ModuleExtension]


LAYERS: dict[type[Module], Layer] = {
    Linear: Layer(StructuredSqrtGGNLinear, _skipping_carried(BatchGradLinear)),
    Conv1d: Layer(
        partial(StructuredSqrtGGNConv, Conv1DDerivatives),
        _skipping_carried(BatchGradConv1d),
    ),
    Conv2d: Layer(
        partial(StructuredSqrtGGNConv, Conv2DDerivatives),
        _skipping_carried(BatchGradConv2d),
    ),
    Conv3d: Layer(
        partial(StructuredSqrtGGNConv, Conv3DDerivatives),
        _skipping_carried(BatchGradConv3d),
    ),
}
"""Module types whose square roots are stored as buffers, not materialized."""


def use_structured_sqrt_ggn(extension: BackpropExtension) -> None:
    """Register the structured square roots of :data:`LAYERS` on an extension.

    Args:
        extension: A square-root extension (exact or Monte-Carlo).
    """
    for module_class, layer in LAYERS.items():
        extension.set_module_extension(module_class, layer.sqrt_ggn(), overwrite=True)


def use_structured_individual_gradients(extension: BackpropExtension) -> None:
    """Register the gradient extensions of :data:`LAYERS` that skip carried ones.

    Args:
        extension: An individual-gradient extension, run after the square roots.
    """
    for module_class, layer in LAYERS.items():
        extension.set_module_extension(
            module_class, layer.individual_gradients(), overwrite=True
        )
