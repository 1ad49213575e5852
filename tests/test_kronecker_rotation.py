"""The batched rotations of a refresh and CholeskyQR against float64 references."""

from __future__ import annotations

import pytest
import torch

from dampednewton.math.kronecker_factors import (
    EIGEN_FIELDS,
    FactorEigen,
    factor_eigen,
    power_rotated,
)
from dampednewton.math.kronecker_rotation import ROTATION_SHIFT, RotationBatch
from dampednewton.math.linalg import cholesky_qr3
from tests.assertions import assert_close
from tests.reference.kronecker import power_rotation

DTYPE = torch.float64


def psd(dim: int, seed: int, decay: float = 0.7, rank: int | None = None):
    """A PSD matrix with the spectrum ``decay**k``, its last ``dim - rank`` zero."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=DTYPE)).Q
    spectrum = decay ** torch.arange(dim, dtype=DTYPE)
    spectrum[dim if rank is None else rank :] = 0
    return (basis * spectrum) @ basis.T


def householder_q(matrix: torch.Tensor) -> torch.Tensor:
    """LAPACK's ``Q`` with its columns signed so that ``R``'s diagonal is positive."""
    q, r = torch.linalg.qr(matrix)
    return q * torch.sign(r.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)


def tall(rows: int, columns: int, seed: int, condition: float = 10.0):
    """A ``rows × columns`` matrix with singular values from 1 down to 1/condition."""
    generator = torch.Generator().manual_seed(seed)
    left = torch.linalg.qr(torch.randn(rows, columns, generator=generator, dtype=DTYPE))
    right = torch.linalg.qr(
        torch.randn(columns, columns, generator=generator, dtype=DTYPE)
    )
    values = torch.logspace(0, -torch.log10(torch.tensor(condition)), columns)
    return (left.Q * values.to(DTYPE)) @ right.Q.T


def test_cholesky_qr3_is_householders_q_with_zero_rows_padded():
    """Stacked matrices of fewer rows padded with zeros: each as LAPACK's QR alone."""
    matrices = [tall(30, 5, seed=0), tall(12, 5, seed=1), tall(5, 5, seed=2)]
    padded = torch.zeros(3, 30, 5, dtype=DTYPE)
    for index, matrix in enumerate(matrices):
        padded[index, : matrix.shape[0]] = matrix
    found = cholesky_qr3(padded)
    for index, matrix in enumerate(matrices):
        rows = matrix.shape[0]
        assert_close(found[index, :rows], householder_q(matrix), atol=1e-12, rtol=0)
        assert torch.equal(found[index, rows:], torch.zeros(30 - rows, 5, dtype=DTYPE))


@pytest.mark.parametrize("condition", [1e4, 1e8, 1e12], ids=lambda c: f"cond{c:.0e}")
def test_cholesky_qr3_stays_orthonormal_when_ill_conditioned(condition):
    """The shifted first pass: ``QᵀQ = I``, ``R = QᵀA`` upper triangular, ``QR = A``."""
    matrix = tall(200, 16, seed=7, condition=condition)
    q = cholesky_qr3(matrix.unsqueeze(0))[0]
    assert_close(q.T @ q, torch.eye(16, dtype=DTYPE), atol=1e-13, rtol=0, name="QᵀQ")
    r = q.T @ matrix
    assert_close(r.tril(-1), torch.zeros_like(r), atol=1e-13, rtol=0, name="tril R")
    assert_close(q @ r.triu(), matrix, atol=1e-13, rtol=0, name="QR")
    assert (r.diagonal() > 0).all()


SINGULAR = 2
"""The position of the singular factor in :func:`rotations`."""


def rotations() -> list[tuple[torch.Tensor, FactorEigen]]:
    """Truncated, whole (``d ≤ r``), singular and stacked factors with old bases."""
    stacked = torch.stack([psd(12, seed=12), psd(12, seed=13)])
    return [
        (psd(20, seed=9, decay=0.8), factor_eigen(psd(20, seed=10, decay=0.8), 5)),
        (psd(6, seed=2), factor_eigen(psd(6, seed=3), 6)),  # whole basis
        (psd(8, seed=4, rank=5), factor_eigen(psd(8, seed=5), 8)),  # SINGULAR
        (stacked, factor_eigen(torch.stack([psd(12, seed=14), psd(12, 15)]), 4)),
        (psd(30, seed=6, decay=0.5), factor_eigen(psd(30, seed=8, decay=0.5), 4)),
    ]


def each_alone(factor, eigen):
    """Stacked factors as a list of single ones (with their eigenpairs)."""
    if factor.dim() == 2:
        return [(factor, eigen)]
    return [
        (factor[i], FactorEigen(*(getattr(eigen, name)[i] for name in EIGEN_FIELDS)))
        for i in range(factor.shape[0])
    ]


def test_a_batched_rotation_is_one_shifted_subspace_iteration():
    """Gram-Schmidt's basis of ``(F + ε·‖F V‖_F·I) V``, ``F``'s Rayleigh quotients."""
    queued = rotations()
    batch = RotationBatch(batched=True)
    indices = [batch.add(factor, eigen) for factor, eigen in queued]
    rotated = batch.solve()
    for index, (factors, eigens) in zip(indices, queued, strict=True):
        found = each_alone(factors, rotated[index])
        for (factor, eigen), (_, new) in zip(
            each_alone(factors, eigens), found, strict=True
        ):
            dim, rank = eigen.vectors.shape
            scale = torch.linalg.matrix_norm(factor @ eigen.vectors)  # ‖F V‖_F
            shifted = factor + ROTATION_SHIFT * scale * torch.eye(dim, dtype=DTYPE)
            expected = power_rotation(shifted, eigen.values, eigen.vectors)
            # CholeskyQR's columns point along the products (R's diagonal > 0).
            ordered = eigen.vectors[:, torch.argsort(eigen.values, descending=True)]
            signs = torch.sign(((shifted @ ordered).flip(-1) * expected).sum(0))
            assert_close(new.vectors, expected * signs, atol=1e-12, name="vectors")
            quotients = torch.einsum("dr,de,er->r", expected, factor, expected)
            assert_close(new.values, quotients.clamp_min(0), atol=1e-12, name="values")
            if rank < dim:
                trace = torch.trace(factor)
                residual = (trace - quotients.sum()) / (dim - rank)
                assert_close(new.residual, residual, name="residual")
            assert_close(new.mean, torch.trace(factor) / dim, name="mean")


def test_rotations_on_the_cpu_are_each_factors_own():
    """Not batched (the CPU's default): exactly :func:`power_rotated`, each alone."""
    queued = rotations()
    batch = RotationBatch()
    indices = [batch.add(factor, eigen) for factor, eigen in queued]
    rotated = batch.solve()
    for index, (factor, eigen) in zip(indices, queued, strict=True):
        alone = power_rotated(factor, eigen)
        for name in EIGEN_FIELDS:
            assert torch.equal(getattr(rotated[index], name), getattr(alone, name))


@pytest.mark.cuda
def test_rotations_on_a_gpu_are_batched_and_equal_the_cpus():
    """On CUDA the default batches: the CPU's batched rotation, to float64 round-off."""
    queued = rotations()
    on_cpu, on_gpu = RotationBatch(batched=True), RotationBatch()
    for factor, eigen in queued:
        on_cpu.add(factor, eigen)
        moved = FactorEigen(*(getattr(eigen, n).cuda() for n in EIGEN_FIELDS))
        on_gpu.add(factor.cuda(), moved)
    for cpu, gpu in zip(on_cpu.solve(), on_gpu.solve(), strict=True):
        for name in EIGEN_FIELDS:
            assert_close(getattr(gpu, name).cpu(), getattr(cpu, name), atol=1e-12)


def test_a_singular_factor_keeps_an_orthonormal_whole_basis():
    """Where ``F V`` is rank-deficient the shift keeps every direction (no NaN)."""
    factor = psd(8, seed=4, rank=3)
    eigen = factor_eigen(psd(8, seed=5), 8)
    batch = RotationBatch(batched=True)
    batch.add(factor, eigen)
    (rotated,) = batch.solve()
    vectors = rotated.vectors
    assert_close(vectors.T @ vectors, torch.eye(8, dtype=DTYPE), atol=1e-12, rtol=0)
    quotients = (vectors.T @ factor @ vectors).diagonal()
    assert_close(rotated.values, quotients.clamp_min(0), atol=1e-12, name="values")
    # The leading directions still follow one iteration of F (their span: F's range).
    leading = vectors[:, -3:]
    projected = leading @ (leading.T @ factor @ leading)
    assert_close(
        factor @ leading, projected, atol=1e-7, rtol=0
    )  # the shift: ε·‖F V‖_F ≈ 2e-8


def test_float32_rotations_are_the_float64_ones_rounded():
    """float32 factors: the products in float32, the QR in float64, cast back."""
    queued = rotations()
    single, double = RotationBatch(batched=True), RotationBatch(batched=True)
    for factor, eigen in queued:
        double.add(factor, eigen)
        single.add(
            factor.float(),
            FactorEigen(*(getattr(eigen, n).float() for n in EIGEN_FIELDS)),
        )
    for index, (low, high) in enumerate(
        zip(single.solve(), double.solve(), strict=True)
    ):
        assert low.vectors.dtype == torch.float32
        vectors = low.vectors.double()
        eye = torch.eye(vectors.shape[-1], dtype=DTYPE)
        assert_close(
            vectors.mT @ vectors, eye.expand_as(vectors.mT @ vectors), atol=1e-6
        )
        if index == SINGULAR:  # its null space's basis is float32's round-off
            continue
        for name in EIGEN_FIELDS:
            assert_close(getattr(low, name).double(), getattr(high, name), atol=1e-5)
