"""Eigensolvers: the float64 retry and the partial (top-k) block Krylov solver."""

from __future__ import annotations

import pytest
import torch

from dampednewton.math.linalg import (
    power_of_two_scale,
    symmetric_eigh,
    symmetric_eigvalsh,
    top_eigh,
)
from tests.assertions import assert_close, assert_close_up_to_sign

SPECTRA = {
    "geometric-decay": lambda n: 0.9 ** torch.arange(n, dtype=torch.float64),
    # Like the MLP's Gram: C-1 large eigenvalues, then a flat tail.
    "cluster-then-tail": lambda n: torch.cat(
        [torch.linspace(1.0, 0.5, 9), torch.linspace(0.06, 0.05, n - 9)]
    ).double(),
    "rank-deficient": lambda n: torch.cat(
        [torch.linspace(2.0, 0.1, 20, dtype=torch.float64), torch.zeros(n - 20)]
    ),
}


def psd_matrix(spectrum: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    n = spectrum.numel()
    Q = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64)).Q
    return (Q * spectrum) @ Q.T


@pytest.mark.parametrize("name", list(SPECTRA))
def test_top_eigh_matches_eigh_in_float64(name):
    matrix = psd_matrix(SPECTRA[name](200), seed=1)
    result = top_eigh(
        matrix, 5, generator=torch.Generator().manual_seed(0), max_blocks=40
    )
    assert result is not None, "block Krylov did not converge"
    evals, evecs = result
    ref_evals, ref_evecs = torch.linalg.eigh(matrix)
    assert_close(evals, ref_evals[-5:], rtol=1e-9, atol=1e-12, name="top evals")
    assert_close_up_to_sign(evecs, ref_evecs[:, -5:], dim=-1, rtol=1e-6, atol=1e-8)


def test_top_eigh_float32_residual_tolerance():
    matrix = psd_matrix(SPECTRA["cluster-then-tail"](300), seed=2)
    evals, evecs = top_eigh(matrix.float(), 10, generator=torch.Generator())
    residual = matrix.float() @ evecs - evecs * evals
    assert (residual.norm(dim=0) / evals[-1] <= 5e-4).all()
    # Bauer-Fike: an eigenvalue lies within the residual norm of each Ritz value.
    ref = torch.linalg.eigvalsh(matrix)[-10:]
    assert_close(evals.double(), ref, atol=5e-4 * ref[-1].item(), rtol=0)


def test_top_eigh_gives_up_without_convergence():
    matrix = psd_matrix(SPECTRA["cluster-then-tail"](200), seed=3)
    assert top_eigh(matrix, 10, max_blocks=2, tolerance=1e-14) is None


def test_symmetric_eigh_float32_agrees_with_float64():
    matrix = psd_matrix(SPECTRA["geometric-decay"](50), seed=4)
    evals, evecs = symmetric_eigh(matrix.float())
    assert evals.dtype == evecs.dtype == torch.float32
    # float32 round-off: eps·‖A‖ ≈ 1.2e-7 per operation, O(n) operations.
    assert_close(evals.double(), torch.linalg.eigvalsh(matrix), atol=1e-5)
    assert_close(symmetric_eigvalsh(matrix.float()).double(), evals.double(), atol=1e-5)


def test_symmetric_eigh_retries_in_float64_on_failure():
    """A non-converging float32 eigh (here: overflow to inf) is retried in float64."""
    matrix = torch.diag(torch.tensor([3e38, 3e38, 1.0])).float()
    evals, _ = symmetric_eigh(matrix)
    assert torch.isfinite(evals).all()
    assert_close(evals.double(), torch.tensor([1.0, 3e38, 3e38], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_power_of_two_scale_brings_the_largest_entry_into_a_half_to_one(dtype):
    largest = [3.0, 1.0, 0.7, 0.5, 1e-30, 2.0**-149, 1e30, -5.0]
    matrices = torch.zeros(len(largest), 2, 3, dtype=dtype)
    matrices[:, 1, 2] = torch.tensor(largest, dtype=dtype)
    matrices[:, 0, 0] = matrices[:, 1, 2] / 4
    scales = power_of_two_scale(matrices)
    assert scales.shape == (len(largest),) and scales.dtype == dtype
    for matrix, scale, value in zip(matrices, scales, largest, strict=True):
        exponent = torch.log2(scale.double())
        assert exponent == exponent.round(), f"{scale} is no power of two"
        ratio = (matrix / scale).abs().max().item()
        assert 0.5 <= ratio < 1, value
        # Dividing by a power of two is exact.
        assert torch.equal(matrix / scale * scale, matrix)
        assert power_of_two_scale(matrix) == scale


@pytest.mark.parametrize("value", [0.0, float("inf"), float("nan")])
def test_power_of_two_scale_is_one_for_zero_or_non_finite_matrices(value):
    for dtype in (torch.float32, torch.float64):
        assert power_of_two_scale(torch.full((3, 3), value, dtype=dtype)) == 1
    assert power_of_two_scale(torch.zeros(2, 0, 0)).tolist() == [1.0, 1.0]
