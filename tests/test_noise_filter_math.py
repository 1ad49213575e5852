"""The noise filter's pure math against dense float64 references.

The moments are checked against their recursion written out per direction, the
rotation against the dense Kronecker product of the two bases, and the filtered step
against a dense solve with the damped Kronecker product (kept and residual blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dampednewton.math.kronecker import kronecker_direction, projections
from dampednewton.math.kronecker_coefficients import layer_coefficients
from dampednewton.math.noise_filter import (
    DirectionMoments,
    advanced,
    filtered,
    rotated,
    signal_fraction,
    stacked_moments,
    unstacked_moments,
)
from tests.assertions import assert_close
from tests.test_kronecker_math import dense_kronecker, truncated_eigen

DTYPE = torch.float64


def orthonormal(dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=DTYPE)).Q


@pytest.mark.parametrize("beta1, beta2", [(0.9, 0.8), (0.0, 0.95)])
def test_moments_and_scales_follow_their_recursion(beta1, beta2):
    generator = torch.Generator().manual_seed(0)
    gammas = [torch.randn(3, 4, generator=generator, dtype=DTYPE) for _ in range(5)]
    gammas[2][0, 0] = 0.0
    moments = None
    first = np.zeros((3, 4))
    second = np.zeros((3, 4))
    for t, gamma in enumerate(gammas, start=1):
        moments = advanced(moments, gamma, beta1, beta2)
        first = beta1 * first + (1 - beta1) * gamma.numpy()
        second = beta2 * second + (1 - beta2) * gamma.numpy() ** 2
        assert_close(moments.first_weight, torch.tensor(1 - beta1**t, dtype=DTYPE))
        assert_close(moments.second_weight, torch.tensor(1 - beta2**t, dtype=DTYPE))
        assert_close(moments.first, torch.from_numpy(first), rtol=1e-13, atol=0)
        assert_close(moments.second, torch.from_numpy(second), rtol=1e-13, atol=0)
        ratio = (np.abs(first) / (1 - beta1**t)) / np.sqrt(second / (1 - beta2**t))
        for floor in (0.0, 0.3):
            expected = np.clip(ratio, floor, 1.0)
            scales = signal_fraction(moments, floor)
            assert_close(scales, torch.from_numpy(expected), rtol=1e-13, atol=0)


def test_a_steady_coefficient_keeps_its_whole_step_and_a_flipping_one_loses_it():
    moments = None
    for t in range(40):
        gamma = torch.tensor([[2.0, (-1.0) ** t, 0.0]], dtype=DTYPE)
        moments = advanced(moments, gamma, 0.95, 0.95)
    scales = signal_fraction(moments, 0.0)
    assert scales[0, 0] == 1.0  # |m̂| = √v̂ up to rounding: clamped to 1
    assert scales[0, 1] < 0.1
    assert scales[0, 2] == 0.0  # never a component (its step is zero): the floor


def test_rotated_moments_are_the_dense_change_of_basis():
    old_out, new_out = orthonormal(3, 1), orthonormal(3, 2)
    old_in, new_in = orthonormal(4, 3), orthonormal(4, 4)
    generator = torch.Generator().manual_seed(5)
    first = torch.randn(3, 4, generator=generator, dtype=DTYPE)
    second = torch.rand(3, 4, generator=generator, dtype=DTYPE)
    weights = torch.tensor(0.3, dtype=DTYPE), torch.tensor(0.6, dtype=DTYPE)
    moments = rotated(
        DirectionMoments(first, second, *weights),
        new_out.T @ old_out,
        old_in.T @ new_in,
    )
    change = torch.kron(new_out, new_in).T @ torch.kron(old_out, old_in)
    assert_close(moments.first.flatten(), change @ first.flatten(), rtol=1e-12)
    assert_close(
        moments.second.flatten(), change.square() @ second.flatten(), rtol=1e-12
    )
    assert (moments.first_weight, moments.second_weight) == weights


@pytest.mark.parametrize("damping", [1e-3, 0.3])
@pytest.mark.parametrize(
    "out_rank, in_rank",
    [(5, 7), (3, 7), (2, 3)],
    ids=["full", "output-truncated", "both-truncated"],
)
def test_the_filter_scales_the_kept_block_of_the_damped_solve(
    out_rank, in_rank, damping
):
    output = truncated_eigen(5, out_rank, seed=5)
    inputs = truncated_eigen(7, in_rank, seed=6)
    generator = torch.Generator().manual_seed(7)
    gradient = torch.randn(5, 7, generator=generator, dtype=DTYPE)
    scales = torch.rand(out_rank, in_rank, generator=generator, dtype=DTYPE)
    coefficients = filtered(layer_coefficients(output, inputs, damping), scales)
    projected = projections(gradient, output, inputs)
    step = kronecker_direction(gradient, output, inputs, coefficients, True, projected)

    damped, undamped = dense_kronecker(output, inputs, damping)
    # u_i ⊗ v_j in the row-major order (i, j) of Γ
    kept = torch.kron(output.vectors.contiguous(), inputs.vectors.contiguous())
    flat_gradient = gradient.flatten()
    # Along a kept direction the solve divides by its damped curvature: removing
    # (1 − ρ) of the gradient's coefficient there scales that step by ρ.
    removed = kept @ ((1 - scales).flatten() * (kept.T @ flat_gradient))
    expected = -torch.linalg.solve(damped, flat_gradient - removed)
    assert_close(step.direction.flatten(), expected, rtol=1e-9, atol=1e-11)
    assert_close(step.slope, flat_gradient @ expected, rtol=1e-9, name="slope")
    assert_close(
        step.curvature, expected @ undamped @ expected, rtol=1e-9, name="curvature"
    )


def test_a_step_without_its_curvature_leaves_the_curvatures():
    output, inputs = truncated_eigen(5, 3, seed=11), truncated_eigen(7, 2, seed=12)
    coefficients = layer_coefficients(output, inputs, 1e-2)
    scales = torch.full((3, 2), 0.5, dtype=DTYPE)
    without = filtered(coefficients, scales, with_curvature=False)
    assert without.curvatures is coefficients.curvatures
    assert_close(without.core, filtered(coefficients, scales).core, rtol=0)


def test_stacked_layers_advance_and_scale_as_each_layer_alone():
    """Two layers, one without moments yet (zero moments, zero corrections)."""
    generator = torch.Generator().manual_seed(5)
    gammas = torch.randn(2, 3, 4, generator=generator, dtype=DTYPE)
    earlier = advanced(
        None, torch.randn(3, 4, generator=generator, dtype=DTYPE), 0.9, 0.8
    )
    zero = torch.zeros(3, 4, dtype=DTYPE)
    fresh = DirectionMoments(zero, zero, zero.new_zeros(()), zero.new_zeros(()))
    stacked = advanced(stacked_moments([earlier, fresh]), gammas, 0.9, 0.8)
    alone = [
        advanced(earlier, gammas[0], 0.9, 0.8),
        advanced(None, gammas[1], 0.9, 0.8),
    ]
    for layer, reference in zip(unstacked_moments(stacked), alone, strict=True):
        for name in ("first", "second", "first_weight", "second_weight"):
            assert torch.equal(getattr(layer, name), getattr(reference, name)), name
    scales = signal_fraction(stacked, 0.1)
    for k, reference in enumerate(alone):
        assert torch.equal(scales[k], signal_fraction(reference, 0.1))
    first_only = advanced(None, gammas, 0.9, 0.8)
    assert first_only.first_weight.shape == (2,)
