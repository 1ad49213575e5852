r"""Damped Newton steps along a layer's Kronecker-factored GGN eigenbasis (pure math).

A layer ``z = W x̃`` (``W`` of shape ``o×i``; a bias is the last column of ``W``, and
``x̃`` ends with a 1) whose weight is shared over ``P`` positions (convolutions, linear
layers on sequences; ``P = 1`` otherwise) has the GGN block (K-FAC; KFC for shared
weights)

.. math::

    G_W \approx S \otimes A, \qquad
    A = \frac{1}{N} \sum_{n,p} \tilde x_{np} \tilde x_{np}^\top, \qquad
    S = \frac{1}{P} \sum_{c,n,p} b_{cnp} b_{cnp}^\top,

with ``b_cnp`` the GGN's square root back-propagated to the layer output (BackPACK's,
which carries the mean's ``1/√N``). With the eigenpairs ``S = Σ_i τ_i u_i u_iᵀ`` and
``A = Σ_j σ_j v_j v_jᵀ``, the directions ``e_ij = u_i ⊗ v_j`` have the curvatures
``λ_ij = τ_i σ_j`` and the slopes ``γ_ij = u_iᵀ Ḡ v_j`` (``Ḡ`` the gradient as a
matrix). The damping of each direction is K-FAC's factored Tikhonov damping,

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
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.math.linalg import symmetric_eigh

POWER_ITERATIONS_FROM_SCRATCH = 4
"""Subspace iterations for a truncated factor's first eigenbasis (later: one, from
the previous basis)."""


def input_factor(inputs: Tensor, bias: bool, num_samples: int) -> Tensor:
    """``A = (1/N) Σ_np x̃ x̃ᵀ`` of a layer's inputs, with a 1 appended for the bias.

    Args:
        inputs: ``[N, P, d_in]`` (or ``[N, d_in]``) layer inputs, unfolded for
            convolutions.
        bias: Whether the layer has a bias (``x̃`` ends with a 1).
        num_samples: ``N``, the samples the mean is over.

    Returns:
        ``A`` ``[d_in (+1), d_in (+1)]``.
    """
    rows = inputs.reshape(-1, inputs.shape[-1])
    factor = rows.T @ rows
    if bias:
        sums = rows.sum(0)
        count = rows.new_full((1, 1), rows.shape[0])
        factor = torch.cat(
            [
                torch.cat([factor, sums[:, None]], dim=1),
                torch.cat([sums[None, :], count], dim=1),
            ]
        )
    return factor / num_samples


def output_factor(backproped: Tensor, scale: float = 1.0) -> Tensor:
    """``S = (scale/P) Σ_cnp b bᵀ`` of a layer's back-propagated square root.

    Args:
        backproped: ``[C, N, P, d_out]`` (or ``[C, N, d_out]``) in BackPACK's scaling
            (the mean's ``1/√N`` included).
        scale: ``N/N'`` when the square root covers a sub-sample of ``N'`` of the
            batch's ``N`` samples (its own mean).

    Returns:
        ``S`` ``[d_out, d_out]``.
    """
    positions = backproped.shape[2] if backproped.dim() == 4 else 1
    rows = backproped.reshape(-1, backproped.shape[-1])
    return (rows.T @ rows) * (scale / positions)


@dataclass(frozen=True)
class FactorEigen:
    """The kept eigenpairs of a Kronecker factor and the value of the rest.

    Attributes:
        values: Kept eigenvalues ``[r]`` (``≥ 0``).
        vectors: Their orthonormal eigenvectors ``[d, r]``.
        residual: The eigenvalue of the rest of the space (0-dim; ``0`` when
            ``r = d``): the mean of the factor's remaining spectrum.
        mean: ``tr F / d`` (0-dim), for the damping's ``π``.
    """

    values: Tensor
    vectors: Tensor
    residual: Tensor
    mean: Tensor

    @property
    def truncated(self) -> bool:
        """Whether some directions share the residual eigenvalue (``r < d``)."""
        return self.vectors.shape[1] < self.vectors.shape[0]


def factor_eigen(
    factor: Tensor, rank: int, previous: Tensor | None = None
) -> FactorEigen:
    """The leading ``rank`` eigenpairs of a PSD factor and its residual eigenvalue.

    A factor of dimension ``≤ rank`` is decomposed exactly (``eigh``). A larger one
    takes one subspace iteration from the previous eigenvectors (or
    :data:`POWER_ITERATIONS_FROM_SCRATCH` from a fixed start) and a Rayleigh-Ritz
    step: the averaged factor moves little between refreshes, as in SOAP's and
    Shampoo's eigenbasis updates.

    Args:
        factor: Symmetric PSD ``[d, d]``.
        rank: Eigenpairs to keep.
        previous: Eigenvectors ``[d, rank]`` of the last refresh, or ``None``.

    Returns:
        The eigenpairs (ascending) and the residual.
    """
    dim = factor.shape[0]
    mean = torch.diagonal(factor).sum() / dim
    if dim <= rank:
        values, vectors = symmetric_eigh(factor)
        return FactorEigen(values.clamp_min(0), vectors, factor.new_zeros(()), mean)
    if previous is None or previous.shape != (dim, rank):
        start = _fixed_start(dim, rank, factor)
        iterations = POWER_ITERATIONS_FROM_SCRATCH
    else:
        start, iterations = previous.to(factor.dtype), 1
    subspace = start
    for _ in range(iterations):
        subspace = torch.linalg.qr(factor @ subspace).Q
    projected = subspace.T @ factor @ subspace
    values, rotation = symmetric_eigh((projected + projected.T) / 2)
    values = values.clamp_min(0)
    residual = ((mean * dim - values.sum()) / (dim - rank)).clamp_min(0)
    return FactorEigen(values, subspace @ rotation, residual, mean)


def _fixed_start(dim: int, rank: int, like: Tensor) -> Tensor:
    """A deterministic Gaussian ``[dim, rank]`` start (a local generator)."""
    generator = torch.Generator().manual_seed(dim * 7919 + rank)
    start = torch.randn(dim, rank, generator=generator, dtype=torch.float64)
    return start.to(device=like.device, dtype=like.dtype)


def damping_pi(output: FactorEigen, inputs: FactorEigen) -> Tensor:
    """K-FAC's ``π = √((tr A/dim A)/(tr S/dim S))`` (0-dim; ``1`` for empty factors).

    Args:
        output: The output-side factor ``S``.
        inputs: The input-side factor ``A``.

    Returns:
        ``π``.
    """
    ratio = inputs.mean / output.mean
    return torch.where(
        torch.isfinite(ratio) & (ratio > 0), ratio, torch.ones_like(ratio)
    ).sqrt()


@dataclass(frozen=True)
class KroneckerStep:
    """A layer's step and its quadratic model.

    Attributes:
        direction: ``s`` ``[d_out, d_in (+1)]``.
        slope: ``ḡᵀs = −Σ γ²/(λ + δ)`` (0-dim).
        curvature: ``sᵀ(S ⊗ A)s = Σ λ γ²/(λ + δ)²`` (0-dim).
    """

    direction: Tensor
    slope: Tensor
    curvature: Tensor


def kronecker_direction(
    gradient: Tensor, output: FactorEigen, inputs: FactorEigen, damping: float
) -> KroneckerStep:
    """The damped Newton step ``s_ij = −γ_ij/(λ_ij + δ_ij)`` along ``u_i ⊗ v_j``.

    With ``U``, ``V`` the kept eigenvectors of ``S`` and ``A``, ``R = ḠV``,
    ``T = UᵀḠ`` and ``Γ = UᵀḠV``, the four blocks (kept or residual side on each
    factor) sum to

    ``s = −[U (Γ ⊙ (C_kk − c_k⊥ − c_⊥k + c_⊥⊥)) Vᵀ + U diag(c_k⊥ − c_⊥⊥) T
    + R diag(c_⊥k − c_⊥⊥) Vᵀ + c_⊥⊥ Ḡ]``

    with ``c = 1/(λ + δ)`` of each block (a residual side's ``τ`` or ``σ`` is its
    residual eigenvalue); blocks of a side without residual vanish.

    Args:
        gradient: ``Ḡ`` ``[d_out, d_in (+1)]``.
        output: Eigenpairs of ``S``.
        inputs: Eigenpairs of ``A``.
        damping: ``δ ≥ 0``.

    Returns:
        The step and its model.
    """
    pi = damping_pi(output, inputs)
    root = math.sqrt(damping)
    out_damped = output.values + root / pi  # τ_i + √δ/π
    in_damped = inputs.values + root * pi  # σ_j + π√δ
    u, v = output.vectors, inputs.vectors
    projected_in = gradient @ v  # R [d_out, r_in]
    gamma = u.T @ projected_in  # Γ [r_out, r_in]
    kept = 1 / (out_damped[:, None] * in_damped[None, :])
    squares = gamma.square()
    slope = (squares * kept).sum()
    curvature = (squares * kept.square() * output.values[:, None] * inputs.values).sum()
    core = kept
    direction: Tensor | None = None
    if output.truncated and inputs.truncated:
        both = 1 / ((output.residual + root / pi) * (inputs.residual + root * pi))
        both_curvature = output.residual * inputs.residual
    else:
        both = gradient.new_zeros(())
        both_curvature = gradient.new_zeros(())
    if inputs.truncated:
        # Kept output side, residual input side: c_k⊥ per row.
        rows = 1 / (out_damped * (inputs.residual + root * pi))
        projected_out = u.T @ gradient  # T [r_out, d_in]
        row_squares = (projected_out.square().sum(1) - squares.sum(1)).clamp_min(0)
        slope = slope + (rows * row_squares).sum()
        curvature = (
            curvature
            + (rows.square() * output.values * inputs.residual * row_squares).sum()
        )
        core = core - rows[:, None]
        direction = u @ ((rows - both)[:, None] * projected_out)
    if output.truncated:
        # Residual output side, kept input side: c_⊥k per column.
        columns = 1 / ((output.residual + root / pi) * in_damped)
        column_squares = (projected_in.square().sum(0) - squares.sum(0)).clamp_min(0)
        slope = slope + (columns * column_squares).sum()
        curvature = (
            curvature
            + (
                columns.square() * output.residual * inputs.values * column_squares
            ).sum()
        )
        core = core - columns[None, :]
        term = (projected_in * (columns - both)) @ v.T
        direction = term if direction is None else direction + term
    if output.truncated and inputs.truncated:
        rest = (
            gradient.square().sum()
            - projected_out.square().sum()
            - projected_in.square().sum()
            + squares.sum()
        ).clamp_min(0)
        slope = slope + both * rest
        curvature = curvature + both.square() * both_curvature * rest
        core = core + both
        assert direction is not None  # both sides truncated: both blocks above ran
        direction = direction + both * gradient
    main = u @ (gamma * core) @ v.T
    direction = main if direction is None else direction + main
    return KroneckerStep(direction=-direction, slope=-slope, curvature=curvature)
