"""Monte-Carlo GGN: the average over independent draws converges to the exact GGN."""

from __future__ import annotations

import pytest
import torch
from backpack import backpack

from dampednewton import EigenvalueThreshold, EighComputation
from tests import reference
from tests.assertions import assert_close
from tests.utils import build_case, make_groups

NUM_DRAWS = 100
MC_SAMPLES = 16


@pytest.mark.slow
def test_mc_ggn_is_unbiased(problem):
    """Each draw's GGN ``V Vᵀ = Σ_k λ_k e_k e_kᵀ`` is unbiased for the exact GGN.

    Entries of ``V Vᵀ`` are bounded (the sampled square roots are bounded for CE/BCE
    and Gaussian for MSE), so by the CLT their mean over ``NUM_DRAWS`` draws is close
    to normal with the empirical standard error. Five standard errors per entry bound
    a false alarm over all ≤ 60² entries at ≈ 2 % (Bonferroni); the seeded
    generator makes the test deterministic. (With 100 draws the standard error is
    estimated to ≈ 7 %, and Student-t tails at 5σ stay below 10⁻⁵ per entry.)
    """
    case = build_case(problem)
    groups = make_groups(case.model, "full", criterion=EigenvalueThreshold(1e-10))
    params = groups[0]["params"]
    generator = torch.Generator().manual_seed(problem.seed)
    computation = EighComputation(
        mc_samples=MC_SAMPLES, warn_small_eigvals=0, generator=generator
    )
    draws = []
    for _ in range(NUM_DRAWS):
        hook = computation.get_extension_hook(groups)
        with backpack(*computation.get_extensions(), extension_hook=hook):
            case.loss_fn(case.model(case.X), case.y).backward()
        evals, evecs = computation.get_result(groups[0])
        E = torch.cat([v.flatten(start_dim=1) for v in evecs], dim=1).T
        draws.append((E * evals) @ E.T)
    draws = torch.stack(draws)
    mean = draws.mean(0)
    standard_error = draws.std(0) / NUM_DRAWS**0.5
    exact = reference.ggn(
        case.reference_model,
        case.reference_loss_fn,
        case.reference_params(params),
        case.X,
        case.y,
    )
    deviation = (mean - exact).abs()
    allowed = 5 * standard_error + 1e-12
    worst = (deviation / allowed).max()
    assert worst <= 1, f"MC mean deviates by {worst:.2f}× the allowed 5 std. errors."
    # Consistency: the error shrinks like 1/√draws (not a constant bias).
    assert_close(mean, exact, atol=10 * standard_error.max().item(), name="MC GGN")


def test_mc_sampling_is_reproducible_and_private(problem):
    """The same generator seed gives the same GGN; the global RNG is untouched."""
    case = build_case(problem)
    groups = make_groups(case.model, "full")
    results = []
    for _ in range(2):
        computation = EighComputation(
            mc_samples=1,
            warn_small_eigvals=0,
            generator=torch.Generator().manual_seed(7),
        )
        groups[0]["criterion"] = EigenvalueThreshold(1e-10)
        global_state = torch.get_rng_state()
        hook = computation.get_extension_hook(groups)
        with backpack(*computation.get_extensions(), extension_hook=hook):
            case.loss_fn(case.model(case.X), case.y).backward()
        assert torch.equal(torch.get_rng_state(), global_state)
        results.append(computation.get_result(groups[0])[0])
    assert torch.equal(results[0], results[1])
