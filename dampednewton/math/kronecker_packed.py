r"""Layers of different shapes in one batched Kronecker step, zero-padded (pure math).

:func:`~dampednewton.math.kronecker.kronecker_direction` steps layers of one shape
together; layers of different shapes take one call each, a dozen small products per
layer. On a GPU, where a step between refreshes is as long as its kernel launches,
that count decides the step's time, not the products' sizes. Padded with zeros to the
group's largest shapes, every layer fits one batch:

* layer ``l``'s gradient ``Ḡ_l`` ``[o_l, i_l]`` is the top-left block of an ``[O, I]``
  matrix (``O = max o_l``, ``I = max i_l``), zero elsewhere;
* its kept eigenvectors ``U_l`` ``[o_l, r_l]`` and ``V_l`` ``[i_l, q_l]`` are the
  top-left blocks of ``[O, R]`` and ``[I, Q]`` matrices (:func:`padded_eigen`);
* its coefficients fill the leading entries of ``[R, Q]``, ``[R]``, ``[Q]`` and a
  number, zeros for the blocks the layer does not have (a factor kept whole has no
  residual side; :func:`padded_coefficients`).

The padded step is exact, layer by layer: a zero row or column of an eigenvector
matrix projects nothing, a zero coefficient adds nothing, and every term of the step
(its kept core, the residual rows and columns, the residual corner ``c_⊥⊥ Ḡ``) is
linear in ``Ḡ``, zero outside the layer's block. The padding costs products: the
batch computes ``L`` times the largest layer's, so it pays where launches cost more
than the padded arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dampednewton.math.kronecker import LayerCoefficients
from dampednewton.math.kronecker_factors import FactorEigen


def batched(tensor: Tensor, matrix_dims: int) -> Tensor:
    """``tensor`` with one leading batch dimension (a layer alone gets one of size 1).

    Args:
        tensor: A layer's tensor, or layers' stacked along a first dimension.
        matrix_dims: The dimensions of one layer's tensor.

    Returns:
        ``[n, ...]``.
    """
    return tensor if tensor.dim() > matrix_dims else tensor.unsqueeze(0)


def padded(tensors: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
    """Batched tensors ``[n_k, ...]`` zero-padded to ``[n_k, *shape]``, concatenated.

    Args:
        tensors: Each with a leading batch dimension and at most ``shape`` after it.
        shape: The padded trailing shape.

    Returns:
        ``[Σ n_k, *shape]``.
    """
    parts = []
    for tensor in tensors:
        pads: list[int] = []
        for size, target in zip(
            reversed(tensor.shape[1:]), reversed(shape), strict=True
        ):
            pads += [0, target - size]
        parts.append(torch.nn.functional.pad(tensor, pads) if any(pads) else tensor)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def padded_eigen(eigen: Sequence[FactorEigen]) -> FactorEigen:
    """Eigenpairs of layers' factors, zero-padded to the largest and stacked.

    Args:
        eigen: Each batch's eigenpairs (one layer's, or layers' stacked).

    Returns:
        ``values [L, R]``, ``vectors [L, D, R]``, ``residual [L]``, ``mean [L]``:
        zero values and vectors beyond each layer's own.
    """
    vectors = [batched(e.vectors, 2) for e in eigen]
    dim = max(v.shape[-2] for v in vectors)
    rank = max(v.shape[-1] for v in vectors)
    return FactorEigen(
        values=padded([batched(e.values, 1) for e in eigen], (rank,)),
        vectors=padded(vectors, (dim, rank)),
        residual=torch.cat([batched(e.residual, 0) for e in eigen]),
        mean=torch.cat([batched(e.mean, 0) for e in eigen]),
    )


def padded_coefficients(
    coefficients: Sequence[LayerCoefficients], ranks: tuple[int, int]
) -> LayerCoefficients:
    """Layers' step coefficients zero-padded to ``ranks = (R, Q)`` and stacked.

    A block a layer does not have (``None``: its factor on that side is kept whole)
    is zero, which drops its term from the layer's step. Curvature fields are left
    out: the padded step computes directions and slopes.

    Args:
        coefficients: Each batch's coefficients (one layer's, or stacked).
        ranks: The padded kept ranks of the output and input sides.

    Returns:
        The stacked coefficients; ``rows``, ``columns`` and ``both`` are ``None``
        only when no layer has that block.
    """
    out_rank, in_rank = ranks
    counts = [batched(c.core, 2).shape[0] for c in coefficients]

    def stacked(name: str, shape: tuple[int, ...]) -> Tensor | None:
        values = [getattr(c, name) for c in coefficients]
        if all(value is None for value in values):
            return None
        like = coefficients[0].core
        parts = [
            like.new_zeros((count, *shape))
            if value is None
            else batched(value, len(shape))
            for value, count in zip(values, counts, strict=True)
        ]
        return padded(parts, shape)

    core = stacked("core", (out_rank, in_rank))
    slopes = stacked("slopes", (out_rank, in_rank))
    assert core is not None and slopes is not None
    return LayerCoefficients(
        slopes=slopes,
        curvatures=None,
        core=core,
        rows=stacked("rows", (out_rank,)),
        columns=stacked("columns", (in_rank,)),
        both=stacked("both", ()),
        row_weights=stacked("row_weights", (out_rank,)),
        column_weights=stacked("column_weights", (in_rank,)),
    )
