r"""The damped Newton step's coefficients in a Kronecker eigenbasis (pure math).

With the eigenpairs ``S = Σ_i τ_i u_i u_iᵀ`` and ``A = Σ_j σ_j v_j v_jᵀ`` of a layer's
factors (:mod:`dampednewton.math.kronecker`), each direction ``u_i ⊗ v_j`` gets the
coefficient ``c_ij = 1/(λ_ij + δ_ij)`` with K-FAC's factored damping,
``λ_ij + δ_ij = (τ_i + √δ/π)(σ_j + π√δ)``: :func:`damped_blocks` for the kept block
and the residual blocks of truncated factors, :func:`layer_coefficients` for what the
step (:func:`~dampednewton.math.kronecker.kronecker_direction`) reads of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from dampednewton.math.kronecker_factors import FactorEigen


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
    (:func:`~dampednewton.math.kronecker.stacked_eigen`) give every layer's
    coefficients, stacked likewise.

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
