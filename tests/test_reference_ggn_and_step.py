"""Self-tests of the brute-force GGN, its eigenpairs, spectra and the damped step."""

from __future__ import annotations

import pytest
import torch

from tests import reference
from tests.assertions import assert_close
from tests.cases import CASES, LINEAR_MSE, PROBLEMS
from tests.utils import full_group, mean_loss_of_parameters, num_nonzero

ALL_PROBLEMS = CASES
ALL_IDS = [problem.id for problem in ALL_PROBLEMS]
LINEAR_PROBLEMS = [p for p in ALL_PROBLEMS if p.id in ("mlp-ce-wide", "linear-mse")]

parametrize_problems = pytest.mark.parametrize(
    "problem", PROBLEMS, ids=[problem.id for problem in PROBLEMS]
)
parametrize_all_problems = pytest.mark.parametrize("problem", ALL_PROBLEMS, ids=ALL_IDS)

# GGN


@parametrize_all_problems
def test_ggn_is_jacobian_sandwich_of_batch_loss_hessian(problem):
    model, loss_fn, params, X, y = full_group(problem)
    outputs = model(X).detach()
    batch_hessian = torch.autograd.functional.hessian(
        lambda f: loss_fn(f, y), outputs
    )  # [N, C, N, C], block-diagonal with blocks H_n / N
    jacobians = reference.output_jacobians(model, params, X)
    expected = torch.einsum("ncd,ncme,mef->df", jacobians, batch_hessian, jacobians)
    assert_close(reference.ggn(model, loss_fn, params, X, y), expected, name="GGN")


@pytest.mark.parametrize("problem", LINEAR_PROBLEMS, ids=lambda p: p.id)
@pytest.mark.parametrize("group", ["all", "weight"])
def test_ggn_equals_hessian_for_models_linear_in_parameters(problem, group):
    model, loss_fn, params, X, y = full_group(problem)
    if group == "weight":
        params = [model[0].weight]
    mean_loss = mean_loss_of_parameters(model, loss_fn, params, X, y)
    theta = reference.flatten([p.detach() for p in params])
    hessian = torch.autograd.functional.hessian(mean_loss, theta)
    assert_close(reference.ggn(model, loss_fn, params, X, y), hessian, name="GGN")


@parametrize_all_problems
def test_ggn_is_mean_of_per_sample_ggns_and_subsamples_the_batch(problem):
    model, loss_fn, params, X, y = full_group(problem)
    num_samples = X.shape[0]
    per_sample = reference.per_sample_ggns(model, loss_fn, params, X, y)
    full = reference.ggn(model, loss_fn, params, X, y)
    assert_close(per_sample.mean(0), full, name="mean of G_n")
    assert_close(
        reference.ggn(model, loss_fn, params, X, y, list(range(num_samples))),
        full,
        name="GGN with all indices",
    )
    subsampling = [num_samples - 1, 0, 2]
    assert_close(
        reference.ggn(model, loss_fn, params, X, y, subsampling),
        reference.ggn(model, loss_fn, params, X[subsampling], y[subsampling]),
        name="subsampled GGN vs. GGN of the sub-batch",
    )


def test_ggn_rejects_bad_subsampling():
    model, loss_fn, params, X, y = full_group(PROBLEMS[0])
    with pytest.raises(ValueError, match="outside"):
        reference.ggn(model, loss_fn, params, X, y, [0, X.shape[0]])
    with pytest.raises(ValueError, match="empty"):
        reference.ggn(model, loss_fn, params, X, y, [])


# Eigenpairs, directional derivatives, damped Newton step


@parametrize_all_problems
def test_ggn_eigenpairs_diagonalize_the_ggn(problem):
    G = reference.ggn(*full_group(problem))
    evals, evecs = reference.ggn_eigenpairs(G)
    assert (evals[1:] >= evals[:-1]).all()
    identity = torch.eye(G.shape[0], dtype=G.dtype)
    assert_close(evecs.T @ evecs, identity, name="EᵀE")
    assert_close(G @ evecs, evecs * evals, atol=1e-12, name="G E vs. E Λ")


def test_ggn_eigenpairs_rejects_asymmetric_matrix():
    with pytest.raises(ValueError, match="not symmetric"):
        reference.ggn_eigenpairs(torch.tensor([[1.0, 2.0], [0.0, 1.0]]))


@parametrize_problems
def test_directional_derivatives_on_a_subsample(problem):
    model, loss_fn, params, X, y = full_group(problem)
    subsampling = [0, 2, 3]
    per_sample = reference.per_sample_ggns(model, loss_fn, params, X, y)
    G_sub = per_sample[subsampling].mean(0)
    grads = reference.per_sample_gradients(model, loss_fn, params, X, y)
    k = num_nonzero(torch.linalg.eigvalsh(G_sub))

    gammas, lambdas, evals, evecs = reference.directional_derivatives(
        G_sub, per_sample[subsampling], grads, k
    )
    assert gammas.shape == (X.shape[0], k)
    assert lambdas.shape == (len(subsampling), k)
    assert_close(evals, torch.linalg.eigvalsh(G_sub)[-k:], name="top-k evals")
    assert_close(G_sub @ evecs, evecs * evals, atol=1e-12, name="G e = λ e")
    assert_close(lambdas.mean(0), evals, name="mean λ_nk")
    assert (lambdas > -1e-12).all(), "per-sample curvatures of a PSD GGN"
    mean_loss = mean_loss_of_parameters(model, loss_fn, params, X, y)
    theta = reference.flatten([p.detach() for p in params])
    for j in range(k):
        _, slope = torch.autograd.functional.jvp(mean_loss, theta, evecs[:, j])
        assert_close(gammas.mean(0)[j], slope, name=f"mean γ along e_{j}")


def test_directional_derivatives_validate_input():
    G = torch.eye(3, dtype=torch.float64)
    Gn, grads = G.expand(2, 3, 3), torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"k must lie in \[1, 3\]"):
        reference.directional_derivatives(G, Gn, grads, 4)
    with pytest.raises(ValueError, match="grads must have shape"):
        reference.directional_derivatives(G, Gn, grads[:, :2], 2)
    with pytest.raises(ValueError, match="Gn must have shape"):
        reference.directional_derivatives(G, G, grads, 2)


@parametrize_all_problems
def test_damped_newton_step_along_all_directions_solves_damped_system(problem):
    model, loss_fn, params, X, y = full_group(problem)
    per_sample = reference.per_sample_ggns(model, loss_fn, params, X, y)
    grads = reference.per_sample_gradients(model, loss_fn, params, X, y)
    G, dim, delta = per_sample.mean(0), per_sample.shape[1], 0.1
    damping = torch.full((dim,), delta, dtype=G.dtype)
    step = reference.damped_newton_step(G, per_sample, grads, dim, damping)
    expected = -torch.linalg.solve(
        G + delta * torch.eye(dim, dtype=G.dtype), grads.mean(0)
    )
    assert_close(step, expected, name="damped Newton step")


def test_undamped_step_along_nonzero_directions_is_pseudo_inverse_newton_step():
    model, loss_fn, params, X, y = full_group(LINEAR_MSE)
    per_sample = reference.per_sample_ggns(model, loss_fn, params, X, y)
    grads = reference.per_sample_gradients(model, loss_fn, params, X, y)
    G = per_sample.mean(0)
    k = num_nonzero(torch.linalg.eigvalsh(G))
    assert k == X.shape[0] * 3 < G.shape[0]
    damping = torch.zeros(k, dtype=G.dtype)
    step = reference.damped_newton_step(G, per_sample, grads, k, damping)
    assert_close(step, -torch.linalg.pinv(G) @ grads.mean(0), name="-G⁺g")
    # The loss is quadratic in θ and the system underdetermined: the step fits.
    mean_loss = mean_loss_of_parameters(model, loss_fn, params, X, y)
    theta = reference.flatten([p.detach() for p in params])
    new_loss = mean_loss(theta + step)
    assert_close(new_loss, torch.zeros_like(new_loss), atol=1e-20, name="loss")


def test_damped_newton_step_validates_damping():
    G = torch.diag(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
    Gn, grads = G.expand(2, 3, 3), torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"damping must have shape \[2\]"):
        reference.damped_newton_step(G, Gn, grads, 2, torch.zeros(3))
    with pytest.raises(ValueError, match="zero curvature"):
        reference.damped_newton_step(G, Gn, grads, 3, torch.zeros(3))


# Spectra of Gram matrix and GGN


@pytest.mark.parametrize(("dim", "columns"), [(7, 4), (4, 7), (5, 5)])
def test_match_spectra_of_random_factor(dim, columns):
    factor = torch.randn(
        dim, columns, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    gram_evals = torch.linalg.eigvalsh(factor.T @ factor)
    ggn_evals = torch.linalg.eigvalsh(factor @ factor.T)
    matched_gram, matched_ggn = reference.match_spectra(gram_evals, ggn_evals)
    assert matched_gram.numel() == min(dim, columns)
    assert_close(matched_gram, matched_ggn, atol=1e-12, name="common spectrum")
    extra = reference.extra_eigenvalues(gram_evals, ggn_evals)
    assert extra.numel() == abs(dim - columns)
    assert_close(extra, torch.zeros_like(extra), atol=1e-12, name="extra evals")


@parametrize_all_problems
def test_match_spectra_of_gram_from_loss_hessian_square_roots(problem):
    model, loss_fn, params, X, y = full_group(problem)
    num_samples = X.shape[0]
    jacobians = reference.output_jacobians(model, params, X)
    with torch.no_grad():
        hessians = reference.loss_hessians(loss_fn, model(X), y)
    weights, bases = torch.linalg.eigh(hessians)
    square_roots = bases * weights.clamp_min(0).sqrt().unsqueeze(1)  # H_n = S Sᵀ
    factor = torch.einsum("ncd,nce->dne", jacobians, square_roots)
    factor = factor.flatten(start_dim=1) / num_samples**0.5  # [D, N·C]
    gram_evals = torch.linalg.eigvalsh(factor.T @ factor)
    ggn_evals = torch.linalg.eigvalsh(reference.ggn(model, loss_fn, params, X, y))
    matched_gram, matched_ggn = reference.match_spectra(gram_evals, ggn_evals)
    assert_close(matched_gram, matched_ggn, atol=1e-12, name="common spectrum")
    extra = reference.extra_eigenvalues(gram_evals, ggn_evals)
    assert_close(extra, torch.zeros_like(extra), atol=1e-12, name="extra evals")


def test_match_spectra_rejects_unsorted_eigenvalues():
    with pytest.raises(ValueError, match="ascending"):
        reference.match_spectra(torch.tensor([2.0, 1.0]), torch.tensor([1.0, 2.0]))
