"""GSNR and noise-scale estimators: formulas and their statistics on synthetic data."""

from __future__ import annotations

import math

import pytest
import torch

from dampednewton.diagnostics.gsnr import (
    debiased_gsnr,
    gsnr,
    gsnr_sums,
    per_sample_variance,
    plain_noise_scale,
    unbiased_noise_scale,
)
from tests.assertions import assert_close

NUM_SAMPLES = 16
NUM_ELEMENTS = 40_000
# Seeded statistical tests: a deviation of more than Z standard errors (estimated
# from the iid elements themselves) has probability < 6e-7 under the CLT.
Z = 5.0


def gaussian_per_sample_gradients(mean: float, seed: int) -> torch.Tensor:
    """``N × D`` iid per-sample gradient elements ~ N(mean, 1)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(
        NUM_SAMPLES, NUM_ELEMENTS, generator=generator, dtype=torch.float64
    )
    return mean + noise


def backpack_quantities(per_sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad, sum_grad_squared)`` as BackPACK stores them for a mean loss."""
    n = per_sample.shape[0]
    return per_sample.mean(0), ((per_sample / n) ** 2).sum(0)


def test_variance_matches_numpy_definition():
    per_sample = gaussian_per_sample_gradients(0.3, seed=0)[:, :50]
    grad, sgs = backpack_quantities(per_sample)
    variance = per_sample_variance(grad, sgs, NUM_SAMPLES)
    expected = torch.from_numpy(per_sample.numpy().var(axis=0, ddof=0))
    assert_close(variance, expected, rtol=1e-10, atol=1e-14, name="variance")


@pytest.mark.parametrize("epsilon", [0.0, 1e-3], ids=["eps0", "eps1e-3"])
def test_gsnr_and_debiased_gsnr_formulas(epsilon):
    per_sample = gaussian_per_sample_gradients(0.2, seed=1)[:, :50]
    grad, sgs = backpack_quantities(per_sample)
    variance = per_sample_variance(grad, sgs, NUM_SAMPLES)
    n = NUM_SAMPLES
    unbiased_variance = per_sample.var(0, correction=1)
    assert_close(
        gsnr(grad, variance, epsilon),
        grad**2 / (variance + epsilon),
        rtol=1e-12,
        name="gsnr",
    )
    if epsilon == 0.0:
        # The derivation's form: ((N−3)/(N−1))·ḡ²/S² − 1/N.
        expected = (n - 3) / (n - 1) * grad**2 / unbiased_variance - 1 / n
        assert_close(
            debiased_gsnr(grad, variance, n, epsilon),
            expected,
            rtol=1e-9,
            atol=1e-12,
            name="debiased gsnr",
        )
    plain = gsnr(grad, variance, epsilon)
    assert_close(
        debiased_gsnr(grad, variance, n, epsilon),
        ((n - 3) * plain - variance / (variance + epsilon)) / n,
        rtol=1e-10,
        atol=1e-14,
        name="debiased gsnr in terms of plain gsnr",
    )


def mean_and_standard_error(values: torch.Tensor) -> tuple[float, float]:
    return values.mean().item(), values.std().item() / math.sqrt(values.numel())


@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
def test_fused_sums_equal_elementwise_estimators(epsilon):
    per_sample = gaussian_per_sample_gradients(0.3, seed=7)[:, :500]
    grad, sgs = backpack_quantities(per_sample)
    variance = per_sample_variance(grad, sgs, NUM_SAMPLES)
    plain, debiased = gsnr_sums(grad, variance, NUM_SAMPLES, epsilon)
    assert_close(plain, gsnr(grad, variance, epsilon).sum(), rtol=1e-12)
    assert_close(
        debiased, debiased_gsnr(grad, variance, NUM_SAMPLES, epsilon).sum(), rtol=1e-11
    )


def test_pure_noise_debiased_gsnr_is_zero_plain_gsnr_is_floor():
    """On pure noise the plain GSNR sits at its floor, the debiased one at 0.

    For Gaussian g_n the plain ratio is χ²₁/χ²_{N−1}, with mean 1/(N−3) (the
    ratio of the expectations gives the usual ≈ 1/(N−1)).
    """
    per_sample = gaussian_per_sample_gradients(0.0, seed=2)
    grad, sgs = backpack_quantities(per_sample)
    variance = per_sample_variance(grad, sgs, NUM_SAMPLES)
    plain, plain_se = mean_and_standard_error(gsnr(grad, variance, 0.0))
    debiased, debiased_se = mean_and_standard_error(
        debiased_gsnr(grad, variance, NUM_SAMPLES, 0.0)
    )
    floor = 1 / (NUM_SAMPLES - 3)
    assert abs(plain - floor) < Z * plain_se, (plain, floor, plain_se)
    assert abs(plain - 1 / (NUM_SAMPLES - 1)) < 0.2 / (NUM_SAMPLES - 1)
    assert abs(debiased) < Z * debiased_se, (debiased, debiased_se)
    assert plain > 20 * plain_se, "the plain estimator must be clearly biased"


def test_debiased_gsnr_is_unbiased_with_signal():
    mean, true_snr = 0.5, 0.25  # σ = 1
    per_sample = gaussian_per_sample_gradients(mean, seed=3)
    grad, sgs = backpack_quantities(per_sample)
    variance = per_sample_variance(grad, sgs, NUM_SAMPLES)
    debiased, se = mean_and_standard_error(
        debiased_gsnr(grad, variance, NUM_SAMPLES, 0.0)
    )
    assert abs(debiased - true_snr) < Z * se, (debiased, true_snr, se)
    # The ratio of the unbiased estimators, ḡ²/S² − 1/N, is off by 2/(N−3)·ρ.
    naive = (grad**2 / per_sample.var(0, correction=1) - 1 / NUM_SAMPLES).mean()
    assert naive.item() - true_snr > Z * se


def test_noise_scale_formulas():
    per_sample = gaussian_per_sample_gradients(0.1, seed=4)[:, :30]
    grad, sgs = backpack_quantities(per_sample)
    variance = per_sample_variance(grad, sgs, NUM_SAMPLES)
    norm, variance_sum = (grad**2).sum(), variance.sum()
    trace = per_sample.var(0, correction=1).sum()
    unbiased = unbiased_noise_scale(norm, variance_sum, NUM_SAMPLES)
    assert_close(unbiased.trace_covariance, trace, rtol=1e-10, name="tr Σ")
    assert_close(
        unbiased.squared_gradient_norm,
        norm - trace / NUM_SAMPLES,
        rtol=1e-10,
        name="|G|²",
    )
    if unbiased.squared_gradient_norm > 0:
        expected = trace / (norm - trace / NUM_SAMPLES)
    else:
        expected = torch.tensor(torch.inf, dtype=torch.float64)
    assert_close(unbiased.noise_scale, expected, rtol=1e-10, name="B_simple")
    plain = plain_noise_scale(norm, variance_sum)
    assert_close(plain.noise_scale, variance_sum / norm, rtol=1e-12, name="plain B")


def test_unbiased_noise_scale_recovers_true_value():
    """μ = 0.5, σ = 1 per element: tr(Σ) = D, |G|² = D/4, B_simple = 4."""
    per_sample = gaussian_per_sample_gradients(0.5, seed=5)
    grad, sgs = backpack_quantities(per_sample)
    variance = per_sample_variance(grad, sgs, NUM_SAMPLES)
    estimate = unbiased_noise_scale(
        (grad**2).sum(), variance.sum(), NUM_SAMPLES
    ).noise_scale
    # Delta method: B̂ − B ≈ Σ_j (t_j − B·h_j)/Σ_j h_j with per-element unbiased
    # parts t_j (trace) and h_j (squared norm), which are iid.
    t = variance * NUM_SAMPLES / (NUM_SAMPLES - 1)
    h = grad**2 - t / NUM_SAMPLES
    se = (t - 4.0 * h).std().item() * math.sqrt(NUM_ELEMENTS) / h.sum().item()
    assert abs(estimate.item() - 4.0) < Z * se, (estimate.item(), se)
    plain = plain_noise_scale((grad**2).sum(), variance.sum()).noise_scale.item()
    # E[Σ V]/E[|ḡ|²] = ((N−1)/N)/(1/4 + 1/N) = 3 for N = 16.
    assert abs(plain - 3.0) < Z * se
    assert abs(plain - 4.0) > 20 * se


def test_noise_scale_without_detectable_signal_is_infinite():
    norm = torch.tensor(0.01, dtype=torch.float64)
    variance_sum = torch.tensor(1.0, dtype=torch.float64)
    estimate = unbiased_noise_scale(norm, variance_sum, 8)
    assert estimate.squared_gradient_norm < 0
    assert estimate.noise_scale.item() == math.inf
    zero = torch.tensor(0.0, dtype=torch.float64)
    assert plain_noise_scale(zero, variance_sum).noise_scale.item() == math.inf


def test_dead_elements_contribute_zero_debiased_gsnr():
    zero = torch.zeros(3, dtype=torch.float64)
    assert debiased_gsnr(zero, zero, 8, 1e-8).abs().max().item() == 0.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda g: debiased_gsnr(g, g, 3, 0.0),
            "debiased GSNR needs a batch of at least 4",
        ),
        (lambda g: gsnr(g, g, -1.0), "epsilon must be ≥ 0"),
        (lambda g: per_sample_variance(g, g[:2], 4), "equal shapes"),
        (
            lambda g: unbiased_noise_scale(g.sum(), g.sum(), 1),
            "unbiased noise scale needs a batch of at least 2",
        ),
    ],
    ids=["debiased-small-batch", "negative-epsilon", "shape-mismatch", "noise-n1"],
)
def test_bad_input_raises(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.ones(3, dtype=torch.float64))
