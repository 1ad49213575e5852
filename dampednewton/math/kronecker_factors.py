r"""A layer's Kronecker factors of its GGN block and their eigenpairs (pure math).

For a layer ``z = W x̃`` shared over ``P`` positions (see
:mod:`dampednewton.math.kronecker` for the step along their eigenbasis):
``A = (1/N) Σ_np x̃ x̃ᵀ`` (:func:`input_factor`) and ``S = Σ_cnp b bᵀ``
(:func:`output_factor`). :func:`factor_eigen` keeps a factor's leading eigenpairs and
the mean of its other eigenvalues (:class:`FactorEigen`); :func:`refreshed_values`
updates the eigenvalues along kept eigenvectors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from dampednewton.math.linalg import power_of_two_scale

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
    rows = inputs.flatten(end_dim=-2)
    if bias:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    factor = rows.T @ rows
    return factor / num_samples


def output_factor(backproped: Tensor, scale: float = 1.0) -> Tensor:
    """``S = scale · Σ_cnp b bᵀ`` of a layer's back-propagated square root.

    Args:
        backproped: ``[C, N, P, d_out]`` (or ``[C, N, d_out]``) in BackPACK's scaling
            (the mean's ``1/√N`` included).
        scale: ``N/N'`` when the square root covers a sub-sample of ``N'`` of the
            batch's ``N`` samples (its own mean).

    Returns:
        ``S`` ``[d_out, d_out]``.
    """
    rows = backproped.reshape(-1, backproped.shape[-1])
    return (rows.T @ rows) * scale


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
        return self.vectors.shape[-1] < self.vectors.shape[-2]


EIGEN_FIELDS = tuple(f.name for f in fields(FactorEigen))
"""The fields of :class:`FactorEigen`, in order."""


def factor_eigen(
    factor: Tensor, rank: int, previous: Tensor | None = None
) -> FactorEigen:
    """The leading ``rank`` eigenpairs of a PSD factor and its residual eigenvalue.

    A factor of dimension ``≤ rank`` is decomposed exactly. A larger one takes one
    subspace iteration from the previous eigenvectors (or
    :data:`POWER_ITERATIONS_FROM_SCRATCH` from a fixed start) and a Rayleigh-Ritz
    step: the averaged factor moves little between refreshes, as in SOAP's and
    Shampoo's eigenbasis updates. The symmetric eigenproblems (at most
    ``rank × rank``) need no check of their result (no host read): a failure raises
    and is solved again in float64; a non-finite factor must not reach them.
    Factors of one shape stacked along leading dimensions are decomposed together
    (batched products and solvers), each as it would be alone; factors of other
    shapes together through :class:`FactorEigenBatch`.

    Args:
        factor: Symmetric PSD ``[..., d, d]``.
        rank: Eigenpairs to keep.
        previous: Eigenvectors ``[..., d, rank]`` of the last refresh, or ``None``.

    Returns:
        The eigenpairs (ascending) and the residual.
    """
    batch = FactorEigenBatch()
    index = batch.add(factor, rank, previous)
    return batch.solve()[index]


@dataclass(frozen=True)
class _EigenProblem:
    """A factor's symmetric eigenproblem: the factor itself, or its Ritz matrix."""

    factor: Tensor
    mean: Tensor
    subspace: Tensor | None  # the orthonormal subspace of a truncated factor
    matrix: Tensor  # what eigh solves: the factor, or subspaceᵀ·factor·subspace


class FactorEigenBatch:
    """Several factors' :func:`factor_eigen`, their eigenproblems solved together.

    A refresh that rotates a network's eigenbases solves one small symmetric
    eigenproblem per factor: the ``rank × rank`` Ritz matrices of the truncated
    factors and the small factors themselves. :meth:`solve` stacks the problems of
    one size (and dtype and device) and solves them in one batched ``eigh`` (on a GPU
    one call, and one synchronization for its check, instead of one per factor);
    each result equals the factor's own :func:`factor_eigen` up to the solver's
    round-off (on the CPU, LAPACK solves each matrix of a batch as it would alone).
    A batch that fails to converge is solved again in float64, whole.
    """

    def __init__(self) -> None:
        """No factors yet."""
        self._problems: list[_EigenProblem] = []

    def add(self, factor: Tensor, rank: int, previous: Tensor | None = None) -> int:
        """Queue a factor (its subspace iterations run now); its index in the result.

        Args:
            factor: Symmetric PSD ``[..., d, d]``.
            rank: Eigenpairs to keep.
            previous: Eigenvectors ``[..., d, rank]`` of the last refresh, or
                ``None``.

        Returns:
            The position of its eigenpairs in :meth:`solve`'s list.
        """
        dim = factor.shape[-1]
        mean = _trace(factor) / dim
        if dim <= rank:
            problem = _EigenProblem(factor, mean, None, factor)
        else:
            if previous is None or previous.shape != (*factor.shape[:-1], rank):
                start = _fixed_start(dim, rank, factor)
                iterations = POWER_ITERATIONS_FROM_SCRATCH
            else:
                start, iterations = previous.to(factor.dtype), 1
            subspace = start
            for _ in range(iterations):
                subspace = torch.linalg.qr(factor @ subspace).Q
            # eigh reads the lower triangle only: the product's round-off asymmetry
            # is moot.
            ritz = subspace.mT @ factor @ subspace
            problem = _EigenProblem(factor, mean, subspace, ritz)
        self._problems.append(problem)
        return len(self._problems) - 1

    def solve(self) -> list[FactorEigen]:
        """Every queued factor's eigenpairs and residual, in the order added."""
        solutions = _batched_eigh([problem.matrix for problem in self._problems])
        return [
            _factor_eigen(problem, values, rotation)
            for problem, (values, rotation) in zip(
                self._problems, solutions, strict=True
            )
        ]


def _factor_eigen(
    problem: _EigenProblem, values: Tensor, rotation: Tensor
) -> FactorEigen:
    """A factor's eigenpairs from its eigenproblem's solution."""
    values = values.clamp_min(0)
    factor, mean = problem.factor, problem.mean
    if problem.subspace is None:
        return FactorEigen(values, rotation, factor.new_zeros(factor.shape[:-2]), mean)
    dim, rank = problem.subspace.shape[-2:]
    residual = ((mean * dim - values.sum(-1)) / (dim - rank)).clamp_min(0)
    return FactorEigen(values, problem.subspace @ rotation, residual, mean)


def _batched_eigh(matrices: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """:func:`_eigh` of each matrix ``[..., n, n]``, one call per size and kind."""
    sizes: dict[tuple, list[int]] = {}
    for index, matrix in enumerate(matrices):
        key = (matrix.shape[-1], matrix.dtype, matrix.device)
        sizes.setdefault(key, []).append(index)
    solved: dict[int, tuple[Tensor, Tensor]] = {}
    for indices in sizes.values():
        if len(indices) == 1:
            solved[indices[0]] = _eigh(matrices[indices[0]])
            continue
        parts = [matrices[i].reshape(-1, *matrices[i].shape[-2:]) for i in indices]
        values, vectors = _eigh(torch.cat(parts))
        counts = [part.shape[0] for part in parts]
        for i, value, vector in zip(
            indices, values.split(counts), vectors.split(counts), strict=True
        ):
            shape = matrices[i].shape
            solved[i] = value.reshape(shape[:-1]), vector.reshape(shape)
    return [solved[index] for index in range(len(matrices))]


def refreshed_values(factor: Tensor, eigen: FactorEigen) -> FactorEigen:
    """New eigenvalues for a factor along its previous eigenvectors.

    The Rayleigh quotients ``σ_j = v_jᵀ F v_j`` (and the residual and mean of the new
    factor): two products instead of an eigendecomposition, for refreshes between
    those that rotate the basis. Exact when ``F`` kept its eigenvectors. Stacked
    factors (``[..., d, d]``, their eigenpairs likewise) are refreshed together.

    Args:
        factor: The new factor ``F`` ``[..., d, d]``.
        eigen: Its previous eigenpairs.

    Returns:
        The eigenpairs along the previous vectors.
    """
    vectors = eigen.vectors
    values = ((factor @ vectors) * vectors).sum(-2).clamp_min(0)
    dim, rank = vectors.shape[-2:]
    mean = _trace(factor) / dim
    residual = (
        ((mean * dim - values.sum(-1)) / (dim - rank)).clamp_min(0)
        if rank < dim
        else factor.new_zeros(factor.shape[:-2])
    )
    return FactorEigen(values, vectors, residual, mean)


def power_rotated(factor: Tensor, eigen: FactorEigen) -> FactorEigen:
    """A factor's eigenpairs by one subspace iteration from its previous ones.

    SOAP's update of its eigenbases, without an eigensolver: the previous vectors,
    largest value first, are multiplied by the new factor and orthonormalized by QR
    (``Q = qr(F V)``); their Rayleigh quotients ``q_jᵀ F q_j`` are the new values.
    Over refreshes the vectors follow the factor's leading eigenvectors
    (simultaneous iteration: the ``j``-th largest converges to the ``j``-th
    eigenvector); exact when ``F`` kept the previous eigenvectors. Returned ascending
    by their previous values, as :func:`factor_eigen` returns them. Stacked factors
    (``[..., d, d]``, their eigenpairs likewise) are rotated together.

    Args:
        factor: The new factor ``F`` ``[..., d, d]``.
        eigen: Its previous eigenpairs.

    Returns:
        The rotated eigenpairs, the residual and the mean of the new factor.
    """
    order = eigen.values.argsort(dim=-1, descending=True)
    previous = eigen.vectors.gather(-1, order.unsqueeze(-2).expand_as(eigen.vectors))
    rotated = torch.linalg.qr(factor @ previous.to(factor.dtype)).Q.flip(-1)
    return refreshed_values(
        factor, FactorEigen(eigen.values, rotated, eigen.residual, eigen.mean)
    )


def _trace(factor: Tensor) -> Tensor:
    """``tr F`` of each of stacked matrices ``[..., d, d]``."""
    return torch.diagonal(factor, dim1=-2, dim2=-1).sum(-1)


def _eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """``eigh`` of power-of-two-scaled matrices, in float64 if LAPACK fails.

    The factors are PSD and each scaled to unit magnitude; a failure to converge
    raises (no host read of the result is needed) and is solved again in float64.
    """
    scale = power_of_two_scale(matrix)
    scaled = matrix / scale[..., None, None]
    try:
        values, vectors = torch.linalg.eigh(scaled)
    except torch.linalg.LinAlgError:
        values, vectors = torch.linalg.eigh(scaled.to(torch.float64))
        values, vectors = values.to(matrix.dtype), vectors.to(matrix.dtype)
    return values * scale[..., None], vectors


def _fixed_start(dim: int, rank: int, like: Tensor) -> Tensor:
    """A deterministic Gaussian ``[..., dim, rank]`` start (a local generator).

    One start for every matrix stacked in ``like`` (``[..., dim, dim]``).
    """
    generator = torch.Generator().manual_seed(dim * 7919 + rank)
    start = torch.randn(dim, rank, generator=generator, dtype=torch.float64)
    start = start.to(device=like.device, dtype=like.dtype)
    return start.expand(*like.shape[:-2], dim, rank)
