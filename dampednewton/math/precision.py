"""The precision of the curvature computations for low-precision models.

A model held in bfloat16 or float16 (``model.to(torch.bfloat16)``) keeps its
parameters and BackPACK's buffers in that precision, but Gram matrices accumulated
in it lose the small eigenvalues, and no CPU eigensolver accepts it. The factors,
their Gram matrix, the eigendecomposition and the step are computed in float32; the
update is rounded to the parameters' precision when it is applied.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOW_PRECISION = (torch.float16, torch.bfloat16)


def computation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the curvature of parameters of ``dtype`` is computed in.

    Args:
        dtype: A parameter's or buffer's dtype.

    Returns:
        ``float32`` for half precisions, else ``dtype``.
    """
    return torch.float32 if dtype in LOW_PRECISION else dtype


def upcast(tensor: Tensor) -> Tensor:
    """``tensor`` in :func:`computation_dtype` (itself if already there).

    Args:
        tensor: Any tensor.

    Returns:
        The tensor, in float32 if it was in half precision.
    """
    return tensor.to(computation_dtype(tensor.dtype))
