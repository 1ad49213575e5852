r"""Damped Newton steps along a layer's Kronecker-factored GGN eigenbasis (pure math).

A layer ``z = W x̃`` (``W`` of shape ``o×i``; a bias is the last column of ``W``, and
``x̃`` ends with a 1) whose weight is shared over ``P`` positions (convolutions, linear
layers on sequences; ``P = 1`` otherwise) has the GGN block (K-FAC; KFC for shared
weights, with the positions summed on both sides)

.. math::

    G_W \approx S \otimes A, \qquad
    A = \frac{1}{N} \sum_{n,p} \tilde x_{np} \tilde x_{np}^\top, \qquad
    S = \sum_{c,n,p} b_{cnp} b_{cnp}^\top,

with ``b_cnp`` the GGN's square root back-propagated to the layer output (BackPACK's,
which carries the mean's ``1/√N``). Both factors sum over the positions: exact for
``P = 1``; for a shared weight it is the curvature of ``P`` perfectly correlated
applications, an upper estimate of the cross-position sum of the true block (KFC's
``S/P`` assumes uncorrelated positions; on the benchmark CNNs the sum reached the
targets in as many or, on fmnist_2c2d, 2-3× fewer steps).

With the eigenpairs ``S = Σ_i τ_i u_i u_iᵀ`` and ``A = Σ_j σ_j v_j v_jᵀ``, the
directions ``e_ij = u_i ⊗ v_j`` have the curvatures ``λ_ij = τ_i σ_j`` and the slopes
``γ_ij = u_iᵀ Ḡ v_j`` (``Ḡ`` the gradient as a matrix). The damping of each direction
is K-FAC's factored Tikhonov damping,

.. math::

    \delta_{ij} = \sqrt\delta\,(\pi \tau_i + \sigma_j / \pi) + \delta, \qquad
    \pi = \sqrt{\frac{\operatorname{tr} A / \dim A}{\operatorname{tr} S / \dim S}},

so that ``λ_ij + δ_ij = (τ_i + √δ/π)(σ_j + π√δ)``: directions stiff in one factor get
more damping. The step is ``s = Σ_ij −γ_ij/(λ_ij + δ_ij) e_ij``.

A factor larger than the kept ``rank`` keeps its leading eigenpairs and gives the rest
of its space one eigenvalue, the mean of its remaining spectrum
(``(tr F − Σ kept)/(dim − rank)``). The step then has four blocks (kept or residual
output side × kept or residual input side) and costs four products of the gradient
with the ``rank`` kept vectors: :func:`kronecker_direction`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.math.kronecker_factors import EIGEN_FIELDS, FactorEigen


def damping_pi(output: FactorEigen, inputs: FactorEigen) -> Tensor:
    """K-FAC's ``π = √((tr A/dim A)/(tr S/dim S))`` (0-dim; ``1`` for empty factors).

    Args:
        output: The output-side factor ``S``.
        inputs: The input-side factor ``A``.

    Returns:
        ``π``.
    """
    ratio = (inputs.mean / output.mean).nan_to_num(nan=1.0, posinf=1.0)
    return ratio.where(ratio > 0, 1.0).sqrt()


@dataclass(frozen=True)
class LayerCoefficients:
    """What a layer's step needs of its eigenvalues and damping (fixed per refresh).

    With ``c = 1/(λ + δ)`` of each block of directions (kept or residual side on
    each factor; see :func:`kronecker_direction`), stored negated where the step
    uses them with a minus sign:

    Attributes:
        slopes: ``−c_kk`` ``[r_out, r_in]``: ``ḡᵀs = Σ Γ² ⊙ slopes + …``.
        curvatures: ``λ_kk c_kk²`` ``[r_out, r_in]``: ``sᵀ(S ⊗ A)s = Σ Γ² ⊙
            curvatures + …`` (this and the other ``*curvature*`` fields are ``None``
            when computed without curvatures).
        core: ``−(c_kk − c_k⊥ − c_⊥k + c_⊥⊥)`` ``[r_out, r_in]``.
        rows: ``c_k⊥`` ``[r_out]`` (``None``: ``A`` keeps its whole space).
        columns: ``c_⊥k`` ``[r_in]`` (``None``: ``S`` keeps its whole space).
        both: ``c_⊥⊥`` (0-dim; ``None`` unless both factors are truncated).
        row_curvatures: ``λ_k⊥ c_k⊥²`` (``None`` with ``rows``).
        column_curvatures: ``λ_⊥k c_⊥k²`` (``None`` with ``columns``).
        both_curvature: ``λ_⊥⊥ c_⊥⊥²`` (``None`` with ``both``).
        row_weights: ``c_⊥⊥ − c_k⊥`` (``None`` with ``rows``; ``c_⊥⊥ = 0`` without
            ``both``), the step's factors of ``T``'s rows.
        column_weights: ``c_⊥⊥ − c_⊥k`` (``None`` with ``columns``), of ``R``'s
            columns.
    """

    slopes: Tensor
    curvatures: Tensor | None
    core: Tensor
    rows: Tensor | None = None
    columns: Tensor | None = None
    both: Tensor | None = None
    row_curvatures: Tensor | None = None
    column_curvatures: Tensor | None = None
    both_curvature: Tensor | None = None
    row_weights: Tensor | None = None
    column_weights: Tensor | None = None


@dataclass(frozen=True)
class DampedBlocks:
    """The four blocks' ``c = 1/(λ + δ)`` of layers (:func:`damped_blocks`).

    Attributes:
        kept: ``c_kk`` ``[..., r_out, r_in]``.
        rows: ``c_k⊥`` ``[..., r_out]`` (``None`` unless asked).
        columns: ``c_⊥k`` ``[..., r_in]`` (``None`` unless asked).
        both: ``c_⊥⊥`` ``[...]`` (``None`` unless asked).
    """

    kept: Tensor
    rows: Tensor | None
    columns: Tensor | None
    both: Tensor | None


def damped_blocks(
    output: FactorEigen,
    inputs: FactorEigen,
    damping: float,
    rows: bool,
    columns: bool,
    both: bool,
) -> DampedBlocks:
    """``c = 1/(λ + δ)`` of the kept block and the residual blocks asked for.

    ``λ_ij + δ_ij = (τ_i + √δ/π)(σ_j + π√δ)``, a residual side using its residual
    eigenvalue. Every tensor may carry leading batch dimensions (stacked layers).

    Args:
        output: Eigenpairs of ``S``.
        inputs: Eigenpairs of ``A``.
        damping: ``δ ≥ 0``.
        rows: Also ``c_k⊥`` (the input side's residual).
        columns: Also ``c_⊥k`` (the output side's residual).
        both: Also ``c_⊥⊥`` (with ``rows`` and ``columns`` only).

    Returns:
        The blocks asked for.
    """
    # π and the residuals keep a trailing 1 to broadcast over a factor's values.
    pi = damping_pi(output, inputs).unsqueeze(-1)
    root = math.sqrt(damping)
    out_shift, in_shift = root / pi, root * pi  # √δ/π and π√δ
    out_damped = output.values + out_shift  # τ_i + √δ/π
    in_damped = inputs.values + in_shift  # σ_j + π√δ
    kept = (out_damped.unsqueeze(-1) * in_damped.unsqueeze(-2)).reciprocal()
    row_block = column_block = corner = None
    if rows:
        in_rest = inputs.residual.unsqueeze(-1) + in_shift
        row_block = (out_damped * in_rest).reciprocal()
    if columns:
        out_rest = output.residual.unsqueeze(-1) + out_shift
        column_block = (out_rest * in_damped).reciprocal()
    if both:
        assert rows and columns
        corner = (out_rest * in_rest).reciprocal().squeeze(-1)
    return DampedBlocks(kept, row_block, column_block, corner)


def layer_coefficients(
    output: FactorEigen,
    inputs: FactorEigen,
    damping: float,
    with_curvature: bool = True,
) -> LayerCoefficients:
    """The blocks' ``c = 1/(λ + δ)`` with K-FAC's factored damping.

    ``λ_ij + δ_ij = (τ_i + √δ/π)(σ_j + π√δ)``, a residual side using its residual
    eigenvalue (:func:`damped_blocks`). Eigenpairs of layers of one shape stacked
    (:func:`stacked_eigen`) give every layer's coefficients, stacked likewise.

    Args:
        output: Eigenpairs of ``S``.
        inputs: Eigenpairs of ``A``.
        damping: ``δ ≥ 0``.
        with_curvature: Also the fields of ``sᵀ(S ⊗ A)s`` (adaptive damping reads
            it); without, they are ``None`` and the refresh saves their products.

    Returns:
        The coefficients.
    """
    has_rows, has_columns = inputs.truncated, output.truncated
    blocks = damped_blocks(
        output, inputs, damping, has_rows, has_columns, has_rows and has_columns
    )
    kept, rows, columns, both = blocks.kept, blocks.rows, blocks.columns, blocks.both
    curvatures = row_curvatures = column_curvatures = both_curvature = None
    if with_curvature:
        curvatures = (
            kept.square() * output.values.unsqueeze(-1) * inputs.values.unsqueeze(-2)
        )
    core = kept
    if rows is not None:
        if with_curvature:
            row_curvatures = (
                rows.square() * output.values * inputs.residual.unsqueeze(-1)
            )
        core = core - rows.unsqueeze(-1)
    if columns is not None:
        if with_curvature:
            column_curvatures = (
                columns.square() * output.residual.unsqueeze(-1) * inputs.values
            )
        core = core - columns.unsqueeze(-2)
    if both is not None:
        if with_curvature:
            both_curvature = both.square() * output.residual * inputs.residual
        core = core + both[..., None, None]
    shared = 0.0 if both is None else both.unsqueeze(-1)
    return LayerCoefficients(
        slopes=-kept,
        curvatures=curvatures,
        core=-core,
        rows=rows,
        columns=columns,
        both=both,
        row_curvatures=row_curvatures,
        column_curvatures=column_curvatures,
        both_curvature=both_curvature,
        row_weights=None if rows is None else shared - rows,
        column_weights=None if columns is None else shared - columns,
    )


def stacked_eigen(eigen: Sequence[FactorEigen]) -> FactorEigen:
    """Eigenpairs of factors of one shape stacked along a new first dimension.

    Args:
        eigen: Each layer's eigenpairs (equal shapes and kept ranks).

    Returns:
        ``values [L, r]``, ``vectors [L, d, r]``, ``residual [L]``, ``mean [L]``.
    """
    return FactorEigen(
        *(torch.stack([getattr(e, name) for e in eigen]) for name in EIGEN_FIELDS)
    )


def unstacked_eigen(eigen: FactorEigen) -> list[FactorEigen]:
    """Each layer's eigenpairs of :func:`stacked_eigen`'s result (views, no copies).

    Args:
        eigen: Eigenpairs stacked along the first dimension.

    Returns:
        One :class:`FactorEigen` per layer.
    """
    fields = (getattr(eigen, name).unbind(0) for name in EIGEN_FIELDS)
    return [FactorEigen(*parts) for parts in zip(*fields, strict=True)]


@dataclass(frozen=True)
class KroneckerStep:
    """A layer's step and its quadratic model.

    Attributes:
        direction: ``s`` ``[d_out, d_in (+1)]``.
        slope: ``ḡᵀs = −Σ γ²/(λ + δ)`` (0-dim).
        curvature: ``sᵀ(S ⊗ A)s = Σ λ γ²/(λ + δ)²`` (0-dim; ``None`` when not
            asked for).
    """

    direction: Tensor
    slope: Tensor
    curvature: Tensor | None


def projections(
    gradient: Tensor, output: FactorEigen, inputs: FactorEigen
) -> tuple[Tensor, Tensor]:
    """``R = ḠV`` and the kept coefficients ``Γ = UᵀḠV`` of a layer's gradient.

    Args:
        gradient: ``Ḡ`` ``[..., d_out, d_in (+1)]``.
        output: Eigenpairs of ``S``.
        inputs: Eigenpairs of ``A``.

    Returns:
        ``(R, Γ)``.
    """
    projected_in = gradient @ inputs.vectors
    return projected_in, output.vectors.mT @ projected_in


def kronecker_direction(
    gradient: Tensor,
    output: FactorEigen,
    inputs: FactorEigen,
    coefficients: LayerCoefficients,
    with_curvature: bool = True,
    projected: tuple[Tensor, Tensor] | None = None,
) -> KroneckerStep:
    """The damped Newton step ``s_ij = −γ_ij/(λ_ij + δ_ij)`` along ``u_i ⊗ v_j``.

    With ``U``, ``V`` the kept eigenvectors of ``S`` and ``A``, ``R = ḠV``,
    ``T = UᵀḠ`` and ``Γ = UᵀḠV``, the four blocks (kept or residual side on each
    factor) sum to

    ``s = −[U (Γ ⊙ (C_kk − c_k⊥ − c_⊥k + c_⊥⊥)) Vᵀ + U diag(c_k⊥ − c_⊥⊥) T
    + R diag(c_⊥k − c_⊥⊥) Vᵀ + c_⊥⊥ Ḡ]``

    with ``c = 1/(λ + δ)`` of each block (:func:`layer_coefficients`); blocks of a
    side without residual vanish. A layer whose factors keep their whole spaces
    costs four matrix products.

    Every tensor may carry the same leading batch dimensions (layers of one shape
    stacked, :func:`stacked_eigen`, and their :func:`layer_coefficients`): the step,
    its slope and curvature then carry them too, one per layer.

    Args:
        gradient: ``Ḡ`` ``[..., d_out, d_in (+1)]``.
        output: Eigenpairs of ``S``.
        inputs: Eigenpairs of ``A``.
        coefficients: :func:`layer_coefficients` of the eigenpairs and ``δ`` (with
            curvatures when ``with_curvature``).
        with_curvature: Also compute ``sᵀ(S ⊗ A)s`` (for adaptive damping).
        projected: :func:`projections` of the gradient, when already computed.

    Returns:
        The step and its model.
    """
    u, v, c = output.vectors, inputs.vectors, coefficients
    # R [..., d_out, r_in], Γ [..., r_out, r_in]
    projected_in, gamma = projected or projections(gradient, output, inputs)
    # s = left·Vᵀ + U·right − c_⊥⊥ Ḡ with the core and the column blocks gathered in
    # left [d_out, r_in], the row blocks in right [r_out, d_in]: two products of size
    # d_out·d_in·r besides R and T.
    left = u @ (gamma * c.core)
    if c.rows is None and c.columns is None:
        squares = gamma.square()
        slope = _inner(squares, c.slopes)
        curvature = None
        if with_curvature:
            assert c.curvatures is not None, "coefficients computed without curvatures"
            curvature = _inner(squares, c.curvatures)
        return KroneckerStep(left @ v.mT, slope, curvature)
    if c.column_weights is not None:
        left.addcmul_(projected_in, c.column_weights.unsqueeze(-2))
    direction = left @ v.mT
    projected_out = None
    if c.row_weights is not None:
        projected_out = u.mT @ gradient  # T [..., r_out, d_in]
        right = c.row_weights.unsqueeze(-1) * projected_out
        if direction.dim() == 2:
            direction.addmm_(u, right)
        else:
            direction.baddbmm_(u, right)
    if c.both is not None:
        direction.addcmul_(gradient, c.both[..., None, None], value=-1)
    slope = _inner(gradient, direction)
    curvature = (
        _truncated_curvature(gradient, gamma, projected_in, projected_out, c)
        if with_curvature
        else None
    )
    return KroneckerStep(direction, slope, curvature)


def _truncated_curvature(
    gradient: Tensor,
    gamma: Tensor,
    projected_in: Tensor,
    projected_out: Tensor | None,
    c: LayerCoefficients,
) -> Tensor:
    """``sᵀ(S ⊗ A)s`` of a step with residual blocks, block by block."""
    squares = gamma.square()
    assert c.curvatures is not None, "coefficients computed without curvatures"
    curvature = _inner(squares, c.curvatures)
    if c.column_curvatures is not None:
        column_squares = (projected_in.square().sum(-2) - squares.sum(-2)).clamp_min(0)
        curvature = curvature + (c.column_curvatures * column_squares).sum(-1)
    if c.row_curvatures is not None:
        assert projected_out is not None
        row_squares = (projected_out.square().sum(-1) - squares.sum(-1)).clamp_min(0)
        curvature = curvature + (c.row_curvatures * row_squares).sum(-1)
    if c.both_curvature is not None:
        assert projected_out is not None
        matrices = (-2, -1)
        rest = (
            gradient.square().sum(matrices)
            - projected_out.square().sum(matrices)
            - projected_in.square().sum(matrices)
            + squares.sum(matrices)
        ).clamp_min(0)
        curvature = curvature + c.both_curvature * rest
    return curvature


def _inner(first: Tensor, second: Tensor) -> Tensor:
    """``Σ first ⊙ second`` over the last two dimensions (one per batch entry)."""
    if first.dim() == 2:
        return torch.dot(first.flatten(), second.flatten())
    return (first * second).sum((-2, -1))
