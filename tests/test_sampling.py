"""Monte-Carlo square roots of the cross-entropy Hessians and the finiteness check."""

from __future__ import annotations

import math

import pytest
import torch

from dampednewton.math.finite import all_finite
from dampednewton.math.sampling import (
    sampled_binary_cross_entropy_gradients,
    sampled_cross_entropy_gradients,
)
from tests.assertions import assert_close


def _cross_entropy_hessian(logits: torch.Tensor) -> torch.Tensor:
    """``diag(p) − ppᵀ`` per sample (and position), classes last ``[..., C, C]``."""
    probs = logits.softmax(dim=1).movedim(1, -1)
    return torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 2, 2)], ids=["NC", "NCHW"])
def test_draws_average_to_the_cross_entropy_hessian(shape):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=generator, dtype=torch.float64)
    mc_samples = 200_000
    draws = sampled_cross_entropy_gradients(logits, mc_samples, generator)
    assert draws.shape == (mc_samples, *shape)
    columns = draws.movedim(2, -1)  # [M, N, *D, C]
    estimate = torch.einsum("m...i,m...j->...ij", columns, columns) / mc_samples
    exact = _cross_entropy_hessian(logits)
    # Each entry averages M bounded terms (|term| ≤ 1): 5 standard errors.
    assert_close(estimate, exact, rtol=0, atol=5 / math.sqrt(mc_samples), name="E[ggᵀ]")
    # Every draw is p − onehot: entries sum to zero over classes.
    assert_close(draws.sum(2), torch.zeros_like(draws.sum(2)), atol=1e-12)


def test_binary_draws_average_to_the_binary_cross_entropy_hessian():
    """Each output's own Bernoulli label: ``E[ggᵀ] = diag(σ(1 − σ))`` per sample."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    mc_samples = 200_000
    draws = sampled_binary_cross_entropy_gradients(logits, mc_samples, generator)
    assert draws.shape == (mc_samples, 3, 4)
    estimate = torch.einsum("mni,mnj->nij", draws, draws) / mc_samples
    probs = logits.sigmoid()
    exact = torch.diag_embed(probs * (1 - probs))
    # Each entry averages M bounded terms (|term| ≤ 1): 5 standard errors.
    assert_close(estimate, exact, rtol=0, atol=5 / math.sqrt(mc_samples), name="E[ggᵀ]")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_binary_draws_in_half_precision_draw_in_float32(dtype):
    """Same labels as from float32 probabilities; no binomial kernel needed."""
    logits = torch.randn(64, 2, generator=torch.Generator().manual_seed(1)).to(dtype)
    half = sampled_binary_cross_entropy_gradients(
        logits, 3, torch.Generator().manual_seed(2)
    )
    single = sampled_binary_cross_entropy_gradients(
        logits.float(), 3, torch.Generator().manual_seed(2)
    )
    assert half.dtype == dtype
    assert torch.equal(half, single.to(dtype))


@pytest.mark.parametrize(
    "sample",
    [sampled_cross_entropy_gradients, sampled_binary_cross_entropy_gradients],
    ids=["cross-entropy", "binary"],
)
def test_draws_of_logits_that_require_grad_record_no_graph(sample):
    """``loss.backward(create_graph=True)`` must not differentiate the draws."""
    logits = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert not sample(logits * 2, 2, torch.Generator().manual_seed(0)).requires_grad


def test_draws_come_from_the_generator_only():
    logits = torch.randn(5, 3, dtype=torch.float64)
    global_state = torch.get_rng_state()
    first = sampled_cross_entropy_gradients(logits, 4, torch.Generator().manual_seed(3))
    again = sampled_cross_entropy_gradients(logits, 4, torch.Generator().manual_seed(3))
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), global_state)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, -2.0], True),
        ([1.0, math.nan], False),
        ([math.inf, 0.0], False),
        ([math.inf, -math.inf], False),
        ([3e38, 3e38], False),  # float32 sum overflows: counted as non-finite
    ],
)
def test_all_finite_detects_nan_inf_and_overflow(values, expected):
    tensor = torch.tensor(values, dtype=torch.float32)
    assert all_finite(tensor) is expected
    assert all_finite(torch.ones(3, dtype=torch.float64), tensor) is expected
    assert all_finite() is True
