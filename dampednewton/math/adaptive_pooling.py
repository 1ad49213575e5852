"""Adaptive average pooling as separable matrices, and its transposed Jacobian.

``AdaptiveAvgPool{1,2,3}d`` averages, for output index ``i`` of a spatial dimension of
input size ``n`` and output size ``m``, the inputs ``⌊i n / m⌋ … ⌈(i + 1) n / m⌉ − 1``
(torch's windows, overlapping where ``m`` does not divide ``n``). A window of several
dimensions is the product of its per-dimension windows, so the pooling applies one
matrix ``P_d`` (``m × n``, rows of ``1/width`` over the window) along each spatial
dimension, and its transposed Jacobian applies ``P_dᵀ``: exact for every size and
dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pooling_matrix(
    inputs: int, outputs: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``P`` ``[outputs, inputs]``: adaptive average pooling along one dimension.

    Args:
        inputs: The input size ``n``.
        outputs: The output size ``m``.
        dtype: The matrix's dtype.
        device: Its device.

    Returns:
        Row ``i`` holds ``1/width`` over the ``i``-th window, zeros elsewhere.
    """
    index = torch.arange(outputs, device=device)
    starts = (index * inputs) // outputs
    ends = -((-(index + 1) * inputs) // outputs)  # ⌈(i + 1) n / m⌉
    columns = torch.arange(inputs, device=device)
    window = (columns >= starts[:, None]) & (columns < ends[:, None])
    return window.to(dtype) / (ends - starts)[:, None].to(dtype)


def adaptive_average_transposed(mat: Tensor, input_sizes: tuple[int, ...]) -> Tensor:
    """The transposed Jacobian of adaptive average pooling applied to ``mat``.

    Args:
        mat: ``[..., *output_sizes]``, the pooled spatial dimensions last.
        input_sizes: The input's spatial sizes, as many as the pooled dimensions.

    Returns:
        ``[..., *input_sizes]``: each spatial dimension multiplied by ``P_dᵀ``.
    """
    spatial = len(input_sizes)
    result = mat
    for offset, size in enumerate(input_sizes):
        dim = mat.dim() - spatial + offset
        matrix = pooling_matrix(size, mat.shape[dim], mat.dtype, mat.device)
        result = torch.tensordot(result, matrix, dims=([dim], [0])).movedim(-1, dim)
    return result
