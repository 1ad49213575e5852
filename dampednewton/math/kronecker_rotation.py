"""Rotations of several factors' eigenbases at one refresh, orthonormalized together.

A rotating refresh past the eigensolved ones (:func:`~dampednewton.math.
kronecker_factors.power_rotated`) takes one subspace iteration per factor: the
previous eigenvectors, largest value first, times the new factor, orthonormalized by
QR. :class:`RotationBatch` queues a refresh's rotations and runs them together. On
the CPU each is :func:`power_rotated` (LAPACK's Householder QR per factor, where a
call costs microseconds). On a GPU, where a refresh is bound by its launches
(torch's QR calls cuSOLVER per matrix, about 24 kernels each: 267 of cifar10_3c3d's
1,326 in a rotating refresh on an H200), the products of every factor are
orthonormalized in one padded batch by :func:`~dampednewton.math.linalg.cholesky_qr`,
which spans the same nested subspaces with the same, non-negative, orientation of
the columns.

CholeskyQR needs a product of full column rank. A factor is PSD, so the iteration
multiplies by ``F + ε·tr(F)·I`` instead of ``F`` (:data:`ROTATION_SHIFT`): its
eigenvectors are ``F``'s, the ratios of its eigenvalues, which set the iteration's
convergence, move by at most ``ε·tr F`` (below float32's round-off of ``F`` itself),
and the product's condition number stays below ``1 + 1/ε`` even where ``F`` is
singular (a zero input feature, the softmax output's null direction). The Rayleigh
quotients along the new vectors are ``F``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.math.kronecker_factors import (
    FactorEigen,
    descending_vectors,
    power_rotated,
    refreshed_values,
)
from dampednewton.math.linalg import cholesky_qr

ROTATION_SHIFT = 1e-8
"""``ε``: the batched rotation iterates with ``F + ε·tr(F)·I`` (module docstring)."""


@dataclass(frozen=True)
class _Rotation:
    factor: Tensor
    eigen: FactorEigen


class RotationBatch:
    """A refresh's :func:`power_rotated` rotations, queued and then run together."""

    def __init__(self, batched: bool | None = None) -> None:
        """No rotations yet.

        Args:
            batched: Orthonormalize every product in one padded CholeskyQR
                (default: off the CPU), or each by :func:`power_rotated`.
        """
        self._batched = batched
        self._rotations: list[_Rotation] = []

    def add(self, factor: Tensor, eigen: FactorEigen) -> int:
        """Queue the rotation of ``eigen`` into ``factor``; its index in the result.

        Args:
            factor: The new factor ``F`` ``[..., d, d]`` (PSD).
            eigen: Its previous eigenpairs (vectors ``[..., d, r]``, ``r ≤ d``).

        Returns:
            The position of its rotated eigenpairs in :meth:`solve`'s list.
        """
        self._rotations.append(_Rotation(factor, eigen))
        return len(self._rotations) - 1

    def solve(self) -> list[FactorEigen]:
        """Every queued rotation's eigenpairs, in the order added."""
        rotations = self._rotations
        if not rotations:
            return []
        batched = self._batched
        if batched is None:
            batched = rotations[0].factor.device.type != "cpu"
        if not batched:
            return [power_rotated(r.factor, r.eigen) for r in rotations]
        starts = [descending_vectors(r.eigen).to(r.factor.dtype) for r in rotations]
        products = [
            r.factor @ start + _shift(r.factor) * start
            for r, start in zip(rotations, starts, strict=True)
        ]
        bases = cholesky_qr(products)
        return [
            refreshed_values(
                r.factor,
                FactorEigen(
                    r.eigen.values, basis.flip(-1), r.eigen.residual, r.eigen.mean
                ),
            )
            for r, basis in zip(rotations, bases, strict=True)
        ]


def _shift(factor: Tensor) -> Tensor:
    """``ε·tr F`` per stacked factor ``[..., 1, 1]`` (``ε`` for a zero factor)."""
    trace = torch.diagonal(factor, dim1=-2, dim2=-1).sum(-1)
    trace = torch.where(trace > 0, trace, torch.ones_like(trace))
    return (ROTATION_SHIFT * trace)[..., None, None]
