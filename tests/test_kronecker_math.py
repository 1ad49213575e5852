"""The Kronecker factors' and step's pure math against dense float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.micro.step_profile import EigensolverCalls
from dampednewton.math.kronecker import kronecker_direction, stacked_eigen
from dampednewton.math.kronecker_coefficients import (
    LayerCoefficients,
    damping_pi,
    layer_coefficients,
)
from dampednewton.math.kronecker_factors import (
    EIGEN_FIELDS,
    FactorEigen,
    FactorEigenBatch,
    factor_eigen,
    input_factor,
    output_factor,
    power_rotated,
    refreshed_values,
)
from tests.assertions import assert_close
from tests.reference.kronecker import power_rotation

DTYPE = torch.float64


def psd(dim: int, seed: int, decay: float = 0.7) -> torch.Tensor:
    """A PSD matrix with the spectrum ``decay**k`` (a clear gap between neighbours)."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=DTYPE)).Q
    return (basis * decay ** torch.arange(dim, dtype=DTYPE)) @ basis.T


def test_input_factor_is_the_mean_of_outer_products_with_a_one_appended():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(5, 3, 4, generator=generator, dtype=DTYPE)
    expected = torch.zeros(5, 5, dtype=DTYPE)
    for sample in inputs:
        for position in sample:
            augmented = torch.cat([position, torch.ones(1, dtype=DTYPE)])
            expected += torch.outer(augmented, augmented)
    assert_close(input_factor(inputs, bias=True, num_samples=5), expected / 5)
    assert_close(input_factor(inputs, bias=False, num_samples=5), expected[:4, :4] / 5)
    flat = inputs[:, 0]  # [N, d_in] inputs of a layer without positions
    assert_close(
        input_factor(flat, bias=False, num_samples=5), flat.T @ flat / 5, name="flat"
    )


def test_output_factor_sums_columns_and_positions():
    generator = torch.Generator().manual_seed(1)
    backproped = torch.randn(2, 5, 3, 4, generator=generator, dtype=DTYPE)
    expected = sum(
        torch.outer(backproped[c, n, p], backproped[c, n, p])
        for c in range(2)
        for n in range(5)
        for p in range(3)
    )
    assert_close(output_factor(backproped), expected)
    assert_close(output_factor(backproped, scale=4.0), 4 * expected)
    assert_close(
        output_factor(backproped[:, :, 0]),
        sum(
            torch.outer(backproped[c, n, 0], backproped[c, n, 0])
            for c in range(2)
            for n in range(5)
        ),
        name="without positions",
    )


def test_a_small_factor_is_decomposed_exactly():
    factor = psd(6, seed=2)
    eigen = factor_eigen(factor, rank=6)
    assert not eigen.truncated
    reconstructed = (eigen.vectors * eigen.values) @ eigen.vectors.T
    assert_close(reconstructed, factor, atol=1e-12)
    assert eigen.residual == 0
    assert_close(eigen.mean, torch.trace(factor) / 6)


def test_a_large_factor_keeps_its_leading_eigenpairs_and_the_mean_of_the_rest():
    factor = psd(30, seed=3, decay=0.5)
    exact_values, exact_vectors = torch.linalg.eigh(factor)
    eigen = factor_eigen(factor, rank=4)
    assert eigen.truncated and eigen.vectors.shape == (30, 4)
    # A gap of 2 between neighbours: four subspace iterations reach about 2**-8 of
    # the next eigenvalue; refreshes from the previous basis converge further.
    for _ in range(40):
        eigen = factor_eigen(factor, rank=4, previous=eigen.vectors)
    assert_close(eigen.values, exact_values[-4:], atol=1e-12, name="kept values")
    overlap = exact_vectors[:, -4:].T @ eigen.vectors
    assert_close(overlap.abs(), torch.eye(4, dtype=DTYPE), atol=1e-9, name="vectors")
    rest = (torch.trace(factor) - exact_values[-4:].sum()) / 26
    assert_close(eigen.residual, rest, atol=1e-12, name="residual")


def test_the_first_subspace_iterations_already_find_a_well_separated_top():
    factor = psd(40, seed=4, decay=0.2)
    eigen = factor_eigen(factor, rank=3)
    exact = torch.linalg.eigvalsh(factor)[-3:]
    assert_close(eigen.values, exact, rtol=1e-4, name="first refresh")


def test_factors_decomposed_together_equal_each_alone_with_one_eigh_per_size(
    device: str,
):
    """Exact and truncated factors, stacked or not: one batched solve per size.

    Compared as projectors ``V diag(λ) Vᵀ`` (a batched solver may choose other signs
    of the eigenvectors: cuSOLVER's Jacobi solver for a batch, not for one matrix).
    """
    stacked = torch.stack([psd(12, seed=5), psd(12, seed=6)]).to(device)
    previous = factor_eigen(stacked, rank=4).vectors
    queued = [
        (psd(4, seed=7), 4, None),  # exact, of the Ritz matrices' size
        (psd(30, seed=3, decay=0.5), 4, None),  # truncated, from the fixed start
        (stacked, 4, previous),  # stacked, one iteration from the previous basis
        (psd(6, seed=2), 6, None),  # exact, a size of its own
        (psd(3, seed=8), 4, None),  # exact, smaller than the rank
    ]
    queued = [(factor.to(device), rank, start) for factor, rank, start in queued]
    batch = FactorEigenBatch()
    indices = [batch.add(*problem) for problem in queued]
    with EigensolverCalls() as calls:
        together = batch.solve()
    assert calls.count == 3  # sizes 4, 6 and 3
    for index, (factor, rank, start) in zip(indices, queued, strict=True):
        alone = factor_eigen(factor, rank, start)
        found = together[index]
        for name in ("values", "residual", "mean"):
            assert_close(getattr(found, name), getattr(alone, name), name=name)
        assert found.vectors.shape == alone.vectors.shape
        if device == "cpu":  # LAPACK solves each matrix of a batch as alone
            assert_close(found.vectors, alone.vectors, name="vectors")
        assert_close(
            (found.vectors * found.values.unsqueeze(-2)) @ found.vectors.mT,
            (alone.vectors * alone.values.unsqueeze(-2)) @ alone.vectors.mT,
            name="eigenpairs",
        )
    exact = together[indices[0]]
    assert_close(
        (exact.vectors * exact.values) @ exact.vectors.T, queued[0][0], atol=1e-12
    )


def test_a_power_rotation_is_one_orthonormalized_subspace_iteration():
    """A truncated factor: Gram-Schmidt's basis, Rayleigh quotients, the rest's mean."""
    factor = psd(20, seed=9, decay=0.8)
    previous = factor_eigen(psd(20, seed=10, decay=0.8), rank=5)
    with EigensolverCalls() as calls:
        rotated = power_rotated(factor, previous)
    assert calls.count == 0
    expected = power_rotation(factor, previous.values, previous.vectors)
    signs = torch.sign((expected * rotated.vectors).sum(0))
    assert_close(rotated.vectors, expected * signs, atol=1e-12, name="vectors")
    quotients = torch.einsum("dr,de,er->r", expected, factor, expected)
    assert_close(rotated.values, quotients, atol=1e-12, name="values")
    trace = torch.trace(factor)
    assert_close(rotated.residual, (trace - quotients.sum()) / 15, name="residual")
    assert_close(rotated.mean, trace / 20, name="mean")


def test_power_rotations_converge_to_the_leading_eigenpairs():
    """From another factor's eigenvectors (ascending), the top ones in order."""
    factor = psd(30, seed=3, decay=0.5)
    exact_values, exact_vectors = torch.linalg.eigh(factor)
    eigen = factor_eigen(psd(30, seed=11, decay=0.9), rank=4)
    for _ in range(60):
        eigen = power_rotated(factor, eigen)
    assert_close(eigen.values, exact_values[-4:], atol=1e-12, name="values")
    overlap = exact_vectors[:, -4:].T @ eigen.vectors
    assert_close(overlap.abs(), torch.eye(4, dtype=DTYPE), atol=1e-9, name="vectors")


def test_stacked_factors_rotate_as_each_alone():
    factors = torch.stack([psd(12, seed=12), psd(12, seed=13)])
    previous = factor_eigen(torch.stack([psd(12, seed=14), psd(12, seed=15)]), 4)
    together = power_rotated(factors, previous)
    for index in range(2):
        alone = power_rotated(
            factors[index],
            FactorEigen(*(getattr(previous, name)[index] for name in EIGEN_FIELDS)),
        )
        for name in EIGEN_FIELDS:
            assert_close(
                getattr(together, name)[index], getattr(alone, name), name=name
            )


def complete(vectors: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the whole space whose first columns are ``vectors``."""
    dim, rank = vectors.shape
    generator = torch.Generator().manual_seed(dim)
    rest = torch.randn(dim, dim - rank, generator=generator, dtype=DTYPE)
    rest = rest - vectors @ (vectors.T @ rest)
    return torch.cat([vectors, torch.linalg.qr(rest).Q], dim=1)


def full_spectrum_matrix(eigen: FactorEigen, shift: torch.Tensor) -> torch.Tensor:
    """``Σ (value + shift) w wᵀ`` over kept and residual directions, dense."""
    basis = complete(eigen.vectors)
    dim, rank = eigen.vectors.shape
    values = torch.cat([eigen.values, eigen.residual.expand(dim - rank)])
    return (basis * (values + shift)) @ basis.T


def dense_kronecker(
    output: FactorEigen, inputs: FactorEigen, damping: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The damped and undamped Kronecker products, dense, with K-FAC's ``π``."""
    pi = damping_pi(output, inputs)
    root = math.sqrt(damping)
    damped = torch.kron(
        full_spectrum_matrix(output, root / pi), full_spectrum_matrix(inputs, root * pi)
    )
    undamped = torch.kron(
        full_spectrum_matrix(output, torch.zeros(())),
        full_spectrum_matrix(inputs, torch.zeros(())),
    )
    return damped, undamped


def truncated_eigen(dim: int, rank: int, seed: int) -> FactorEigen:
    factor = psd(dim, seed, decay=0.6)
    eigen = factor_eigen(factor, rank)
    for _ in range(30):  # converged, so that the kept values are eigenvalues
        eigen = factor_eigen(factor, rank, previous=eigen.vectors)
    return eigen


@pytest.mark.parametrize("damping", [0.0, 1e-3, 0.3])
@pytest.mark.parametrize(
    "out_rank, in_rank",
    [(5, 7), (3, 7), (5, 2), (2, 3)],
    ids=["full", "output-truncated", "input-truncated", "both-truncated"],
)
def test_direction_inverts_the_damped_kronecker_product(out_rank, in_rank, damping):
    output = truncated_eigen(5, out_rank, seed=5)
    inputs = truncated_eigen(7, in_rank, seed=6)
    generator = torch.Generator().manual_seed(7)
    gradient = torch.randn(5, 7, generator=generator, dtype=DTYPE)
    step = kronecker_direction(
        gradient, output, inputs, layer_coefficients(output, inputs, damping)
    )

    damped, undamped = dense_kronecker(output, inputs, damping)
    flat_gradient = gradient.flatten()
    expected = -torch.linalg.solve(damped, flat_gradient)
    assert_close(step.direction.flatten(), expected, rtol=1e-9, atol=1e-11)
    assert_close(step.slope, flat_gradient @ expected, rtol=1e-9, name="slope")
    assert_close(
        step.curvature, expected @ undamped @ expected, rtol=1e-9, name="curvature"
    )


@pytest.mark.parametrize(
    "out_rank, in_rank",
    [(5, 7), (3, 7), (5, 2), (2, 3)],
    ids=["full", "output-truncated", "input-truncated", "both-truncated"],
)
def test_stacked_layers_step_as_each_layer_alone(out_rank, in_rank):
    """Three layers of one shape in one batched call: each layer's own step."""
    outputs = [truncated_eigen(5, out_rank, seed=20 + k) for k in range(3)]
    inputs = [truncated_eigen(7, in_rank, seed=30 + k) for k in range(3)]
    generator = torch.Generator().manual_seed(40)
    gradients = torch.randn(3, 5, 7, generator=generator, dtype=DTYPE)
    coefficients = [
        layer_coefficients(output, eigen, 0.01)
        for output, eigen in zip(outputs, inputs, strict=True)
    ]
    stacked_output, stacked_input = stacked_eigen(outputs), stacked_eigen(inputs)
    stacked_coefficients = layer_coefficients(stacked_output, stacked_input, 0.01)
    for name, value in vars(stacked_coefficients).items():
        each = [getattr(c, name) for c in coefficients]
        if value is None:
            assert each[0] is None, name
        else:
            assert_close(value, torch.stack(each), rtol=1e-14, name=name)
    batched = kronecker_direction(
        gradients, stacked_output, stacked_input, stacked_coefficients
    )
    assert batched.direction.shape == (3, 5, 7)
    assert batched.slope.shape == batched.curvature.shape == (3,)
    for k in range(3):
        alone = kronecker_direction(
            gradients[k], outputs[k], inputs[k], coefficients[k]
        )
        damped, undamped = dense_kronecker(outputs[k], inputs[k], 0.01)
        expected = -torch.linalg.solve(damped, gradients[k].flatten())
        assert_close(alone.direction.flatten(), expected, rtol=1e-9, atol=1e-11)
        assert_close(batched.direction[k], alone.direction, rtol=1e-12, atol=1e-14)
        assert_close(batched.slope[k], alone.slope, rtol=1e-12, name="slope")
        assert_close(batched.curvature[k], alone.curvature, rtol=1e-12)
        assert_close(alone.curvature, expected @ undamped @ expected, rtol=1e-9)


@pytest.mark.parametrize("damping", [1e-4, 0.1])
def test_full_rank_direction_is_kfac_with_factored_tikhonov_damping(damping):
    output_matrix, input_matrix = psd(4, seed=8), psd(6, seed=9)
    gradient = torch.randn(4, 6, generator=torch.Generator().manual_seed(10)).double()
    output, inputs = factor_eigen(output_matrix, 4), factor_eigen(input_matrix, 6)
    step = kronecker_direction(
        gradient, output, inputs, layer_coefficients(output, inputs, damping)
    )
    pi = math.sqrt((torch.trace(input_matrix) / 6) / (torch.trace(output_matrix) / 4))
    root = math.sqrt(damping)
    expected = -torch.linalg.solve(
        output_matrix + root / pi * torch.eye(4, dtype=DTYPE),
        gradient,
    ) @ torch.linalg.inv(input_matrix + root * pi * torch.eye(6, dtype=DTYPE))
    assert_close(step.direction, expected, rtol=1e-9, atol=1e-12)


def test_pi_is_one_for_an_empty_factor():
    empty = FactorEigen(
        torch.zeros(2, dtype=DTYPE),
        torch.eye(2, dtype=DTYPE),
        torch.zeros((), dtype=DTYPE),
        torch.zeros((), dtype=DTYPE),
    )
    assert damping_pi(empty, empty) == 1


def test_the_curvature_is_left_out_when_not_asked_for():
    output, inputs = truncated_eigen(5, 3, seed=11), truncated_eigen(7, 2, seed=12)
    gradient = torch.randn(5, 7, generator=torch.Generator().manual_seed(13)).double()
    coefficients = layer_coefficients(output, inputs, 0.01)
    full = kronecker_direction(gradient, output, inputs, coefficients)
    lean = kronecker_direction(
        gradient, output, inputs, coefficients, with_curvature=False
    )
    assert lean.curvature is None
    assert torch.equal(lean.direction, full.direction)
    assert torch.equal(lean.slope, full.slope)


@pytest.mark.parametrize(
    "out_rank, in_rank",
    [(5, 7), (3, 7), (5, 2), (3, 2)],
    ids=["full", "output-truncated", "input-truncated", "both-truncated"],
)
def test_coefficients_without_curvature_leave_only_the_curvature_out(out_rank, in_rank):
    output = truncated_eigen(5, out_rank, seed=21)
    inputs = truncated_eigen(7, in_rank, seed=22)
    full = layer_coefficients(output, inputs, 0.01)
    lean = layer_coefficients(output, inputs, 0.01, with_curvature=False)
    curvature_fields = {
        "curvatures",
        "row_curvatures",
        "column_curvatures",
        "both_curvature",
    }
    for name in LayerCoefficients.__dataclass_fields__:
        kept, computed = getattr(full, name), getattr(lean, name)
        if name in curvature_fields:
            assert computed is None, name
        elif kept is None:
            assert computed is None, name
        else:
            assert torch.equal(computed, kept), name
    gradient = torch.randn(5, 7, generator=torch.Generator().manual_seed(23)).double()
    step = kronecker_direction(gradient, output, inputs, lean, with_curvature=False)
    assert torch.equal(
        step.direction, kronecker_direction(gradient, output, inputs, full).direction
    )


def test_refreshed_values_are_the_rayleigh_quotients_along_the_kept_vectors():
    old, new = psd(9, seed=14), psd(9, seed=15)
    for rank in (9, 4):
        eigen = factor_eigen(old, rank)
        refreshed = refreshed_values(new, eigen)
        assert refreshed.vectors is eigen.vectors
        expected = torch.einsum("dr,de,er->r", eigen.vectors, new, eigen.vectors)
        assert_close(refreshed.values, expected.clamp_min(0), atol=1e-12)
        assert_close(refreshed.mean, torch.trace(new) / 9)
        rest = (torch.trace(new) - expected.sum()) / (9 - rank) if rank < 9 else 0.0
        assert_close(
            refreshed.residual, torch.as_tensor(rest, dtype=DTYPE).clamp_min(0)
        )
    # Where the factor kept its eigenvectors, the refresh is its decomposition.
    exact = factor_eigen(new, 9)
    assert_close(refreshed_values(2 * new, exact).values, 2 * exact.values, atol=1e-12)
