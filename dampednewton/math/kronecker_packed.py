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
  residual side; :func:`padded_coefficients`, computed for every layer at once from
  the padded eigenpairs and :func:`padding_masks`).

The padded step is exact, layer by layer: a zero row or column of an eigenvector
matrix projects nothing, a zero coefficient adds nothing, and every term of the step
(its kept core, the residual rows and columns, the residual corner ``c_⊥⊥ Ḡ``) is
linear in ``Ḡ``, zero outside the layer's block. The padding costs products: the
batch computes ``L`` times the largest layer's, so it pays where launches cost more
than the padded arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.math.kronecker_coefficients import LayerCoefficients, damped_blocks
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


def batched_fields(eigen: Sequence[FactorEigen]) -> list[Tensor]:
    """Each batch's eigenpair fields with a leading batch dimension, in order.

    Args:
        eigen: Each batch's eigenpairs (one layer's, or layers' stacked).

    Returns:
        ``values``, ``vectors``, ``residual``, ``mean`` of the first batch, then of
        the next: the order of :func:`block_views`.
    """
    dims = {"values": 1, "vectors": 2, "residual": 0, "mean": 0}
    return [batched(getattr(e, name), dims[name]) for e in eigen for name in dims]


def block_views(padded: FactorEigen, eigen: Sequence[FactorEigen]) -> list[Tensor]:
    """The views of padded eigenpairs that hold each batch's (:func:`padded_eigen`).

    Args:
        padded: Eigenpairs padded to the batches' largest shapes and stacked.
        eigen: Each batch's eigenpairs.

    Returns:
        The leading blocks, in the order of :func:`batched_fields`.
    """
    views = []
    start = 0
    for each in eigen:
        vectors = batched(each.vectors, 2)
        end = start + vectors.shape[0]
        dim, rank = vectors.shape[-2:]
        views += [
            padded.values[start:end, :rank],
            padded.vectors[start:end, :dim, :rank],
            padded.residual[start:end],
            padded.mean[start:end],
        ]
        start = end
    return views


def padded_eigen(eigen: Sequence[FactorEigen]) -> FactorEigen:
    """Eigenpairs of layers' factors, zero-padded to the largest and stacked.

    Args:
        eigen: Each batch's eigenpairs (one layer's, or layers' stacked).

    Returns:
        ``values [L, R]``, ``vectors [L, D, R]``, ``residual [L]``, ``mean [L]``:
        zero values and vectors beyond each layer's own, in new memory.
    """
    sources = batched_fields(eigen)
    vectors = sources[1::4]
    layers = sum(v.shape[0] for v in vectors)
    dim = max(v.shape[-2] for v in vectors)
    rank = max(v.shape[-1] for v in vectors)
    like = vectors[0]
    padded = FactorEigen(
        values=like.new_zeros(layers, rank),
        vectors=like.new_zeros(layers, dim, rank),
        residual=like.new_zeros(layers),
        mean=like.new_zeros(layers),
    )
    torch._foreach_copy_(block_views(padded, eigen), sources)
    return padded


@dataclass(frozen=True)
class PaddingMasks:
    """Which entries of a pack's padded coefficients belong to a layer's blocks.

    Attributes:
        kept: ``[L, R, Q]``: inside layer ``l``'s kept ranks ``r_l × q_l``.
        rows: ``[L, R]``: ``c_k⊥`` of a layer whose input side is truncated.
        columns: ``[L, Q]``: ``c_⊥k`` of a layer whose output side is truncated.
        both: ``[L]``: ``c_⊥⊥`` of a layer truncated on both sides.
        any_rows: Whether some layer has the rows block (else it is left out).
        any_columns: Whether some layer has the columns block.
        any_both: Whether some layer has the corner.
    """

    kept: Tensor
    rows: Tensor
    columns: Tensor
    both: Tensor
    any_rows: bool
    any_columns: bool
    any_both: bool


def padding_masks(
    output: Sequence[tuple[int, int]], inputs: Sequence[tuple[int, int]], like: Tensor
) -> PaddingMasks:
    """The masks of layers with factors of the given dimensions and kept ranks.

    Args:
        output: Each layer's ``(d_out, r_out)``.
        inputs: Each layer's ``(d_in (+1), r_in)``.
        like: A tensor on the masks' device.

    Returns:
        The masks.
    """
    out_rank = max(rank for _, rank in output)
    in_rank = max(rank for _, rank in inputs)

    def within(ranks: list[int], size: int) -> Tensor:
        positions = torch.arange(size, device=like.device)
        return positions < torch.tensor(ranks, device=like.device).unsqueeze(-1)

    rows_in = within([rank for _, rank in output], out_rank)
    columns_in = within([rank for _, rank in inputs], in_rank)
    has_rows = [rank < dim for dim, rank in inputs]
    has_columns = [rank < dim for dim, rank in output]
    has_both = [r and c for r, c in zip(has_rows, has_columns, strict=True)]
    flags = torch.tensor([has_rows, has_columns, has_both], device=like.device)
    return PaddingMasks(
        kept=rows_in.unsqueeze(-1) & columns_in.unsqueeze(-2),
        rows=rows_in & flags[0].unsqueeze(-1),
        columns=columns_in & flags[1].unsqueeze(-1),
        both=flags[2],
        any_rows=any(has_rows),
        any_columns=any(has_columns),
        any_both=any(has_both),
    )


def padded_coefficients(
    output: FactorEigen, inputs: FactorEigen, damping: float, masks: PaddingMasks
) -> LayerCoefficients:
    """Every layer's step coefficients from padded eigenpairs, zero where it has none.

    :func:`~dampednewton.math.kronecker_coefficients.layer_coefficients` of each layer
    in the leading entries of ``[R, Q]``, ``[R]``, ``[Q]`` and a number, computed for
    the whole pack at once. A block a layer does not have (its factor on that side
    kept whole) is zero, which drops its term from the layer's step; a block no layer
    has is ``None``. Curvature fields are left out: the padded step computes
    directions and slopes.

    Args:
        output: Padded eigenpairs of the ``S`` factors (:func:`padded_eigen`).
        inputs: Padded eigenpairs of the ``A`` factors.
        damping: ``δ ≥ 0``.
        masks: The layers' blocks (:func:`padding_masks`).

    Returns:
        The stacked coefficients.
    """
    blocks = damped_blocks(
        output, inputs, damping, masks.any_rows, masks.any_columns, masks.any_both
    )
    # The terms in layer_coefficients' order: a layer's own values round alike.
    kept = torch.where(masks.kept, blocks.kept, 0.0)
    core = kept
    rows = columns = both = row_weights = column_weights = None
    if blocks.rows is not None:
        rows = torch.where(masks.rows, blocks.rows, 0.0)
        core = core - rows.unsqueeze(-1)
    if blocks.columns is not None:
        columns = torch.where(masks.columns, blocks.columns, 0.0)
        core = core - columns.unsqueeze(-2)
    shared: Tensor | float = 0.0
    if blocks.both is not None:
        both = torch.where(masks.both, blocks.both, 0.0)
        core = core + both[..., None, None]
        shared = both.unsqueeze(-1)
    if rows is not None:
        row_weights = torch.where(masks.rows, shared - rows, 0.0)
    if columns is not None:
        column_weights = torch.where(masks.columns, shared - columns, 0.0)
    return LayerCoefficients(
        slopes=-kept,
        curvatures=None,
        core=-torch.where(masks.kept, core, 0.0),
        rows=rows,
        columns=columns,
        both=both,
        row_weights=row_weights,
        column_weights=column_weights,
    )
