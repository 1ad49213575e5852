"""A convolution's input patches (im2col) for any number of spatial dimensions.

The weight of ``nn.Conv1d/2d/3d`` (one group, zero padding) acts on each output
position ``p`` as a linear layer on the patch ``x_p`` of input values under the
kernel: ``y_p = W x_p`` with ``W = weight.flatten(1)``. :func:`conv_patches` lays
the patches out as a linear layer's inputs, ``[N, P, C_in·K_1⋯K_d]``: for 2-D inputs
on the CPU with torch's native im2col (``F.unfold``, its ``[N, C_in·ΠK, P]`` result
transposed, as BackPACK does), otherwise with views (``Tensor.unfold``) and one copy
(``views``). BackPACK unfolds 1-D and 3-D inputs with a convolution by
one-hot kernels (``unfoldNd``), which costs ``C_in·ΠK`` multiply-adds per patch entry:
11–14× longer on the MNIST-1D CNN's 25-channel layers. On the CPU the views were as
fast as ``F.unfold`` on some DeepOBS layers and up to 1.9× slower on others, so 2-D
keeps the native route there; on CUDA torch's im2col launches one kernel per sample
(cifar10_3c3d's three convolutions at batch 128: 384 of a refresh's 1,326 kernels on
an H200), the views one copy per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def conv_patches(
    inputs: Tensor,
    kernel_size: Sequence[int],
    *,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    views: bool | None = None,
) -> Tensor:
    """The patches of ``inputs`` under a convolution's kernel.

    Args:
        inputs: ``[N, C_in, S_1, …, S_d]``.
        kernel_size: ``(K_1, …, K_d)``.
        stride: Per spatial dimension.
        padding: Zeros added on both sides, per spatial dimension.
        dilation: Per spatial dimension.
        views: Take 2-D ones by views of the (zero-padded) input and one copy too,
            not by torch's im2col (default: off the CPU; module docstring). 1-D and
            3-D inputs always take the views.

    Returns:
        ``[N, P, C_in·K_1⋯K_d]`` with ``P = O_1⋯O_d`` output positions in row-major
        order and each patch ordered as ``weight.flatten(1)``'s columns
        (``C_in``, then ``K_1``, …, ``K_d``); from im2col a transposed view.

    Raises:
        ValueError: If the lengths of the arguments do not match the input's
            spatial dimensions.
    """
    dims = inputs.dim() - 2
    if not len(kernel_size) == len(stride) == len(padding) == len(dilation) == dims:
        raise ValueError(
            f"conv_patches: a {dims}-d input needs {dims} kernel sizes, strides, "
            f"paddings and dilations, got {tuple(kernel_size)}, {tuple(stride)}, "
            f"{tuple(padding)} and {tuple(dilation)}"
        )
    if views is None:
        views = inputs.device.type != "cpu"
    if dims == 2 and not views:
        return torch.nn.functional.unfold(
            inputs,
            tuple(kernel_size),
            dilation=tuple(dilation),
            padding=tuple(padding),
            stride=tuple(stride),
        ).transpose(1, 2)
    pads = [amount for pad in reversed(padding) for amount in (pad, pad)]
    windows = torch.nn.functional.pad(inputs, pads) if any(pads) else inputs
    for dim, (size, step, spread) in enumerate(
        zip(kernel_size, stride, dilation, strict=True)
    ):
        windows = windows.unfold(2 + dim, (size - 1) * spread + 1, step)
    if any(spread > 1 for spread in dilation):
        taps = [slice(None)] * (2 + dims) + [slice(None, None, d) for d in dilation]
        windows = windows[tuple(taps)]
    # windows: [N, C_in, O_1, …, O_d, K_1, …, K_d]
    order = [0, *range(2, 2 + dims), 1, *range(2 + dims, 2 + 2 * dims)]
    positions = windows.shape[2 : 2 + dims].numel()
    return windows.permute(order).reshape(inputs.shape[0], positions, -1)
