"""Rotations of several factors' eigenbases at one refresh, orthonormalized together.

A rotating refresh past the eigensolved ones (:func:`~dampednewton.math.
kronecker_factors.power_rotated`) takes one subspace iteration per factor: the
previous eigenvectors, largest value first, times the new factor, orthonormalized by
QR, and the factor's Rayleigh quotients along the new vectors. :class:`RotationBatch`
queues a refresh's rotations and runs them together. On the CPU each is
:func:`power_rotated` (LAPACK's Householder QR per factor, where a call costs
microseconds). On a GPU a refresh is bound by its launches (torch's QR calls
cuSOLVER per matrix, about 24 kernels each: 267 of cifar10_3c3d's 1,326 in a rotating
refresh on an H200), so the factors whose bases have one column count (and dtype and
device) are padded with zero rows into one batch: their ordering by the previous
values, the QR (:func:`~dampednewton.math.linalg.cholesky_qr3`, in float64) and the
Rayleigh quotients run batched, and per factor only its two products with ``F``,
its trace and the copy of its new vectors remain. The batched QR spans the same
nested subspaces as Householder's, its columns oriented along the products.

CholeskyQR needs a product of full column rank. A factor is PSD, so the batched
iteration multiplies by ``F + s·I`` instead of ``F``, with ``s = ε·‖F V‖_F``
(:data:`ROTATION_SHIFT`; ``s = ε`` for a zero factor): its eigenvectors are ``F``'s,
the ratios of its eigenvalues, which set the iteration's convergence, move by about
``ε`` (below float32's round-off of ``F`` itself), and the product keeps full rank
even where ``F`` is singular (a zero input feature, the softmax output's null
direction), with a condition number of about ``1/ε`` at most where ``V`` holds
``F``'s leading eigenvector. The Rayleigh quotients are ``F``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dampednewton.math.kronecker_factors import FactorEigen, power_rotated
from dampednewton.math.linalg import cholesky_qr3

ROTATION_SHIFT = 1e-8
"""``ε``: the batched rotation iterates with ``F + ε·‖F V‖_F·I`` (module docstring)."""


@dataclass(frozen=True)
class _Rotation:
    factor: Tensor
    eigen: FactorEigen


class RotationBatch:
    """A refresh's :func:`power_rotated` rotations, queued and then run together."""

    def __init__(self, batched: bool | None = None) -> None:
        """No rotations yet.

        Args:
            batched: Rotate the factors in padded batches (default: off the CPU),
                or each by :func:`power_rotated`.
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
        groups: dict[tuple, list[int]] = {}
        for index, rotation in enumerate(rotations):
            vectors = rotation.eigen.vectors
            key = (vectors.shape[-1], rotation.factor.dtype, rotation.factor.device)
            groups.setdefault(key, []).append(index)
        rotated: dict[int, FactorEigen] = {}
        for indices in groups.values():
            found = _rotated_together([rotations[i] for i in indices])
            rotated.update(zip(indices, found, strict=True))
        return [rotated[index] for index in range(len(rotations))]


def _rotated_together(rotations: list[_Rotation]) -> list[FactorEigen]:
    """Rotations whose bases share a column count, dtype and device: one batch.

    Each factor's stack ``[L, d, d]`` (or one ``[d, d]``) takes ``L`` entries of the
    batch, padded to the largest ``d`` with zero rows.
    """
    first = rotations[0].factor
    dtype, columns = first.dtype, rotations[0].eigen.vectors.shape[-1]
    dims = [r.factor.shape[-1] for r in rotations]
    counts = [r.factor[..., 0, 0].numel() for r in rotations]
    rows = max(dims)
    # Products F·V and the vectors V, padded: [2, B, rows, columns].
    padded = first.new_zeros(2, sum(counts), rows, columns)
    targets, sources, offsets = [], [], []
    offset = 0
    for rotation, dim, count in zip(rotations, dims, counts, strict=True):
        vectors = rotation.eigen.vectors.to(dtype)
        for side, source in enumerate((rotation.factor @ vectors, vectors)):
            targets.append(padded[side, offset : offset + count, :dim])
            sources.append(source.reshape(count, dim, columns))
        offsets.append(offset)
        offset += count
    torch._foreach_copy_(targets, sources)
    values = torch.cat([r.eigen.values.reshape(-1, columns) for r in rotations])
    order = values.argsort(dim=-1, descending=True)
    padded = padded.to(torch.float64).gather(
        -1, order.expand(2, *order.shape).unsqueeze(-2).expand_as(padded)
    )
    products, starts = padded
    norms = products.square().sum(dim=(-2, -1)).sqrt()
    shift = ROTATION_SHIFT * torch.where(norms > 0, norms, torch.ones_like(norms))
    basis = cholesky_qr3(torch.addcmul(products, shift[:, None, None], starts))
    basis = basis.flip(-1).to(dtype)  # ascending by the previous values
    # Rayleigh quotients q_jᵀ F q_j of every factor's new vectors, batched.
    images = torch.zeros_like(basis)
    targets, sources, news = [], [], []
    for rotation, dim, count, offset in zip(
        rotations, dims, counts, offsets, strict=True
    ):
        new = basis[offset : offset + count, :dim].clone()
        new = new.reshape(rotation.eigen.vectors.shape)
        news.append(new)
        targets.append(images[offset : offset + count, :dim])
        sources.append((rotation.factor @ new).reshape(count, dim, columns))
    torch._foreach_copy_(targets, sources)
    quotients = (images * basis).sum(-2).clamp_min(0)
    totals = quotients.sum(-1)
    found = []
    for rotation, new, dim, count, offset in zip(
        rotations, news, dims, counts, offsets, strict=True
    ):
        shape = rotation.eigen.values.shape
        trace = torch.diagonal(rotation.factor, dim1=-2, dim2=-1).sum(-1)
        residual = (
            (
                (trace - totals[offset : offset + count].reshape(shape[:-1]))
                / (dim - columns)
            ).clamp_min(0)
            if columns < dim
            else trace.new_zeros(trace.shape)
        )
        found.append(
            FactorEigen(
                quotients[offset : offset + count].reshape(shape),
                new,
                residual,
                trace / dim,
            )
        )
    return found
