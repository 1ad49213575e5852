"""The precision of the curvature computations for low-precision models.

A model held in bfloat16 or float16 (``model.to(torch.bfloat16)``) keeps its
parameters and BackPACK's buffers in that precision, but Gram matrices accumulated
in it lose the small eigenvalues, and no CPU eigensolver accepts it. The factors,
their Gram matrix, the eigendecomposition and the step are computed in float32; the
update is rounded to the parameters' precision when it is applied. The eigenvalues at
the half-precision buffers' rounding level count as zero (:func:`without_rounding`).
"""

from __future__ import annotations

from collections.abc import Iterable

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


def source_dtype(params: Iterable[Tensor]) -> torch.dtype:
    """The coarsest dtype among ``params`` (the precision BackPACK's buffers had).

    Args:
        params: A group's parameters (at least one).

    Returns:
        The dtype with the largest machine epsilon.
    """
    return max((p.dtype for p in params), key=lambda dtype: torch.finfo(dtype).eps)


def without_rounding(evals: Tensor, source: torch.dtype) -> Tensor:
    """Eigenvalues of a Gram matrix ``VᵀV`` with those at ``V``'s rounding set to 0.

    ``V`` rounded to a half precision (unit round-off ``u``) moves every singular
    value by up to about ``u·‖V‖``, so a null direction of ``VᵀV`` gets an
    eigenvalue up to about ``u²·λ_max`` however exactly ``VᵀV`` is then formed in
    float32: positive eigenvalues up to ``ε²·λ_max`` (``ε = 2u``, the dtype's
    epsilon) are round-off, not curvature. Negative ones stay (they are no
    curvature either).

    Args:
        evals: All eigenvalues of the Gram matrix (float32 or wider).
        source: The dtype ``V`` was held in (:func:`source_dtype`).

    Returns:
        ``evals``, unchanged unless ``source`` is a half precision.
    """
    if source not in LOW_PRECISION or evals.numel() == 0:
        return evals
    floor = evals.max().clamp(min=0) * torch.finfo(source).eps ** 2
    return evals.where(evals > floor, evals.clamp(max=0))
