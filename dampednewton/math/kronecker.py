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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.math.kronecker_coefficients import LayerCoefficients
from dampednewton.math.kronecker_factors import EIGEN_FIELDS, FactorEigen


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

    with ``c = 1/(λ + δ)`` of each block
    (:func:`~dampednewton.math.kronecker_coefficients.layer_coefficients`); blocks of a
    side without residual vanish. A layer whose factors keep their whole spaces
    costs four matrix products.

    Every tensor may carry the same leading batch dimensions (layers of one shape
    stacked, :func:`stacked_eigen`, and their
    :func:`~dampednewton.math.kronecker_coefficients.layer_coefficients`): the step,
    its slope and curvature then carry them too, one per layer.

    Args:
        gradient: ``Ḡ`` ``[..., d_out, d_in (+1)]``.
        output: Eigenpairs of ``S``.
        inputs: Eigenpairs of ``A``.
        coefficients: :func:`~.kronecker_coefficients.layer_coefficients` of the
            eigenpairs and ``δ`` (with curvatures when ``with_curvature``).
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
