"""Self-tests of the test problems, the brute-force references and the assertions."""

from __future__ import annotations

import pickle

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad, SqrtGGNExact
from torch import Tensor, nn
from torch.func import functional_call

from tests import reference
from tests.assertions import (
    assert_close,
    assert_close_up_to_sign,
    assert_close_with_direction_signs,
)
from tests.cases import CASES, DIAGNOSTICS, LINEAR_MSE, PROBLEMS, Problem

ALL_PROBLEMS = CASES
ALL_IDS = [problem.id for problem in ALL_PROBLEMS]
LINEAR_PROBLEMS = [p for p in ALL_PROBLEMS if p.id in ("mlp-ce-wide", "linear-mse")]
ZERO_TOL = 1e-12  # relative to the largest eigenvalue

parametrize_problems = pytest.mark.parametrize(
    "problem", PROBLEMS, ids=[problem.id for problem in PROBLEMS]
)
parametrize_all_problems = pytest.mark.parametrize("problem", ALL_PROBLEMS, ids=ALL_IDS)


def _parameter_names(model: nn.Module, params: list[Tensor]) -> list[str]:
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for p in params]


def _mean_loss_of_parameters(
    model: nn.Module, loss_fn: nn.Module, params: list[Tensor], X: Tensor, y: Tensor
):
    names = _parameter_names(model, params)

    def mean_loss(theta: Tensor) -> Tensor:
        overrides = dict(zip(names, reference.unflatten(theta, params), strict=True))
        return loss_fn(functional_call(model, overrides, (X,)), y)

    return mean_loss


def _num_nonzero(evals: Tensor) -> int:
    return int((evals > ZERO_TOL * evals.max()).sum())


def _full_group(problem: Problem):
    model, loss_fn, X, y = problem.build()
    return model, loss_fn, list(model.parameters()), X, y


# Problems


def test_problem_ids_are_unique():
    ids = [problem.id for problem in CASES]
    assert len(set(ids)) == len(ids)


@parametrize_all_problems
def test_build_is_deterministic_fresh_and_leaves_global_rng_alone(problem):
    rng_state = torch.get_rng_state()
    model1, _, X1, y1 = problem.build()
    model2, _, X2, y2 = problem.build()
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert torch.equal(X1, X2)
    assert torch.equal(y1, y2)
    for p1, p2 in zip(model1.parameters(), model2.parameters(), strict=True):
        assert p1 is not p2
        assert p1.dtype == torch.float64
        assert torch.equal(p1, p2)


@parametrize_all_problems
def test_build_casts_to_dtype(problem):
    model64, _, X64, y64 = problem.build()
    model32, _, X32, y32 = problem.build(torch.float32)
    assert X32.dtype == torch.float32
    assert_close(X32, X64.float(), rtol=0, atol=0, name="X")
    if y64.is_floating_point():
        assert_close(y32, y64.float(), rtol=0, atol=0, name="y")
    else:
        assert torch.equal(y32, y64)
    for p32, p64 in zip(model32.parameters(), model64.parameters(), strict=True):
        assert_close(p32, p64.float(), rtol=0, atol=0, name="parameter")


def test_build_rejects_integer_dtype():
    with pytest.raises(ValueError, match="floating-point"):
        PROBLEMS[0].build(torch.int64)


@parametrize_all_problems
def test_problem_is_tiny(problem):
    model, _, params, X, _ = _full_group(problem)
    outputs = model(X)
    if DIAGNOSTICS in problem.tags:
        assert 6 <= X.shape[0] <= 8, "the debiased GSNR needs a few samples"
    else:
        assert 4 <= X.shape[0] <= 6
    assert outputs.shape in ((X.shape[0], 3), (X.shape[0], 1))
    # The convolution with few positions needs enough channels to be structured.
    assert sum(p.numel() for p in params) <= 450


def test_problems_are_picklable():
    restored = pickle.loads(pickle.dumps(ALL_PROBLEMS))
    for original, copy in zip(ALL_PROBLEMS, restored, strict=True):
        assert copy == original
        assert torch.equal(copy.build()[2], original.build()[2])


@parametrize_problems
def test_nonzero_eigenvalues_are_simple_and_not_small(problem):
    evals = torch.linalg.eigvalsh(reference.ggn(*_full_group(problem)))
    nonzero = evals[-_num_nonzero(evals) :]
    assert nonzero.min() > 1e-4, "eigenvalues must stay above the warning threshold"
    relative_gaps = (nonzero[1:] - nonzero[:-1]) / nonzero[1:]
    assert relative_gaps.min() > 1e-3, "eigenvectors must be unique up to sign"


@parametrize_all_problems
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_references_follow_backpack_conventions(problem):
    model, loss_fn, params, X, y = _full_group(problem)
    expected_ggn = reference.ggn(model, loss_fn, params, X, y)
    expected_grads = reference.per_sample_gradients(model, loss_fn, params, X, y)

    model, loss_fn = extend(model), extend(loss_fn)
    with backpack(SqrtGGNExact(), BatchGrad()):
        loss_fn(model(X), y).backward()
    sqrt_ggn = torch.cat([p.sqrt_ggn_exact.flatten(start_dim=2) for p in params], 2)
    sqrt_ggn = sqrt_ggn.flatten(end_dim=1)  # [C·N, D]
    grad_batch = torch.cat([p.grad_batch.flatten(start_dim=1) for p in params], 1)

    assert_close(sqrt_ggn.T @ sqrt_ggn, expected_ggn, name="V Vᵀ vs. GGN")
    assert_close(X.shape[0] * grad_batch, expected_grads, name="N·grad_batch")


# Flattening


def test_flatten_unflatten_round_trip():
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), torch.ones(2, 1, 2)]
    vector = reference.flatten(tensors)
    assert_close(vector, torch.tensor([0, 1, 2, 3, 4, 5, 7, 1, 1, 1, 1.0]))
    for restored, original in zip(
        reference.unflatten(vector, tensors), tensors, strict=True
    ):
        assert_close(restored, original)


def test_unflatten_rejects_wrong_length():
    with pytest.raises(ValueError, match="length 3"):
        reference.unflatten(torch.zeros(4), [torch.zeros(3)])


def test_parameter_group_is_validated():
    model, loss_fn, params, X, y = _full_group(PROBLEMS[0])
    with pytest.raises(ValueError, match="not parameters of the model"):
        reference.ggn(model, loss_fn, [nn.Parameter(torch.zeros(2))], X, y)
    with pytest.raises(ValueError, match="more than once"):
        reference.ggn(model, loss_fn, [params[0], params[0]], X, y)
    with pytest.raises(ValueError, match="empty"):
        reference.per_sample_gradients(model, loss_fn, [], X, y)


# Losses, gradients, Jacobians


@parametrize_all_problems
def test_per_sample_losses_average_to_batch_loss(problem):
    model, loss_fn, _, X, y = _full_group(problem)
    outputs = model(X)
    assert_close(
        reference.per_sample_losses(loss_fn, outputs, y).mean(),
        loss_fn(outputs, y),
        name="mean per-sample loss",
    )


@parametrize_all_problems
def test_mean_per_sample_gradient_is_gradient_of_mean_loss(problem):
    model, loss_fn, params, X, y = _full_group(problem)
    expected = reference.flatten(torch.autograd.grad(loss_fn(model(X), y), params))
    grads = reference.per_sample_gradients(model, loss_fn, params, X, y)
    assert_close(grads.mean(0), expected, name="mean per-sample gradient")


@parametrize_all_problems
def test_per_sample_gradient_is_jacobian_transpose_output_gradient(problem):
    model, loss_fn, params, X, y = _full_group(problem)
    outputs = model(X).detach().requires_grad_()
    losses = reference.per_sample_losses(loss_fn, outputs, y)
    (output_grads,) = torch.autograd.grad(losses.sum(), outputs)
    jacobians = reference.output_jacobians(model, params, X)
    assert_close(
        torch.einsum("ncd,nc->nd", jacobians, output_grads),
        reference.per_sample_gradients(model, loss_fn, params, X, y),
        name="J_nᵀ ∇_f ℓ_n",
    )


@parametrize_problems
def test_jacobians_of_a_subgroup_are_column_blocks(problem):
    model, _, params, X, _ = _full_group(problem)
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0)
    full = reference.output_jacobians(model, params, X)
    subgroup = [len(params) - 1, 0]  # out of order on purpose
    expected = torch.cat([full[:, :, offsets[i] : offsets[i + 1]] for i in subgroup], 2)
    actual = reference.output_jacobians(model, [params[i] for i in subgroup], X)
    assert_close(actual, expected, name="subgroup Jacobian")


# Loss Hessians


def _outputs_and_labels() -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(42)
    outputs = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (4,), generator=generator)
    binary = torch.randint(0, 2, (4, 3), generator=generator).to(torch.float64)
    return outputs, labels, binary


def test_cross_entropy_hessian_is_softmax_covariance():
    outputs, labels, _ = _outputs_and_labels()
    p = outputs.softmax(dim=1)
    expected = torch.diag_embed(p) - torch.einsum("ni,nj->nij", p, p)
    actual = reference.loss_hessians(nn.CrossEntropyLoss(), outputs, labels)
    assert_close(actual, expected, name="CE Hessian")


def test_mse_hessian_is_scaled_identity():
    outputs, _, targets = _outputs_and_labels()
    expected = (2 / 3) * torch.eye(3, dtype=torch.float64).expand(4, 3, 3)
    actual = reference.loss_hessians(nn.MSELoss(), outputs, targets)
    assert_close(actual, expected, name="MSE Hessian")


def test_bce_with_logits_hessian_is_diagonal_sigmoid_derivative():
    outputs, _, targets = _outputs_and_labels()
    s = outputs.sigmoid()
    expected = torch.diag_embed(s * (1 - s) / 3)
    actual = reference.loss_hessians(nn.BCEWithLogitsLoss(), outputs, targets)
    assert_close(actual, expected, name="BCE Hessian")


# GGN


@parametrize_all_problems
def test_ggn_is_jacobian_sandwich_of_batch_loss_hessian(problem):
    model, loss_fn, params, X, y = _full_group(problem)
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
    model, loss_fn, params, X, y = _full_group(problem)
    if group == "weight":
        params = [model[0].weight]
    mean_loss = _mean_loss_of_parameters(model, loss_fn, params, X, y)
    theta = reference.flatten([p.detach() for p in params])
    hessian = torch.autograd.functional.hessian(mean_loss, theta)
    assert_close(reference.ggn(model, loss_fn, params, X, y), hessian, name="GGN")


@parametrize_all_problems
def test_ggn_is_mean_of_per_sample_ggns_and_subsamples_the_batch(problem):
    model, loss_fn, params, X, y = _full_group(problem)
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
    model, loss_fn, params, X, y = _full_group(PROBLEMS[0])
    with pytest.raises(ValueError, match="outside"):
        reference.ggn(model, loss_fn, params, X, y, [0, X.shape[0]])
    with pytest.raises(ValueError, match="empty"):
        reference.ggn(model, loss_fn, params, X, y, [])


# Eigenpairs, directional derivatives, damped Newton step


@parametrize_all_problems
def test_ggn_eigenpairs_diagonalize_the_ggn(problem):
    G = reference.ggn(*_full_group(problem))
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
    model, loss_fn, params, X, y = _full_group(problem)
    subsampling = [0, 2, 3]
    per_sample = reference.per_sample_ggns(model, loss_fn, params, X, y)
    G_sub = per_sample[subsampling].mean(0)
    grads = reference.per_sample_gradients(model, loss_fn, params, X, y)
    k = _num_nonzero(torch.linalg.eigvalsh(G_sub))

    gammas, lambdas, evals, evecs = reference.directional_derivatives(
        G_sub, per_sample[subsampling], grads, k
    )
    assert gammas.shape == (X.shape[0], k)
    assert lambdas.shape == (len(subsampling), k)
    assert_close(evals, torch.linalg.eigvalsh(G_sub)[-k:], name="top-k evals")
    assert_close(G_sub @ evecs, evecs * evals, atol=1e-12, name="G e = λ e")
    assert_close(lambdas.mean(0), evals, name="mean λ_nk")
    assert (lambdas > -1e-12).all(), "per-sample curvatures of a PSD GGN"
    mean_loss = _mean_loss_of_parameters(model, loss_fn, params, X, y)
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
    model, loss_fn, params, X, y = _full_group(problem)
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
    model, loss_fn, params, X, y = _full_group(LINEAR_MSE)
    per_sample = reference.per_sample_ggns(model, loss_fn, params, X, y)
    grads = reference.per_sample_gradients(model, loss_fn, params, X, y)
    G = per_sample.mean(0)
    k = _num_nonzero(torch.linalg.eigvalsh(G))
    assert k == X.shape[0] * 3 < G.shape[0]
    damping = torch.zeros(k, dtype=G.dtype)
    step = reference.damped_newton_step(G, per_sample, grads, k, damping)
    assert_close(step, -torch.linalg.pinv(G) @ grads.mean(0), name="-G⁺g")
    # The loss is quadratic in θ and the system underdetermined: the step fits.
    mean_loss = _mean_loss_of_parameters(model, loss_fn, params, X, y)
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
    model, loss_fn, params, X, y = _full_group(problem)
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


# Assertions


def test_assert_close_passes_within_tolerance():
    expected = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    assert_close(expected * (1 + 5e-8) + 5e-11, expected)


def test_assert_close_reports_the_worst_element():
    expected = torch.zeros(2, 3, dtype=torch.float64)
    actual = expected.clone()
    actual[1, 2] = 1e-3
    actual[0, 1] = 1e-9
    with pytest.raises(AssertionError) as error:
        assert_close(actual, expected, name="quantity")
    message = str(error.value)
    for expected_text in (
        "quantity",
        "2 of 6 elements",
        "max abs diff: 1.000000e-03",
        "index (1, 2)",
        "atol=1e-10",
        "rtol=1e-07",
    ):
        assert expected_text in message


def test_assert_close_rejects_shape_dtype_and_nan_mismatches():
    values = torch.ones(3, dtype=torch.float64)
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close(values, torch.ones(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match="dtype mismatch"):
        assert_close(values, values.float())
    with pytest.raises(AssertionError, match="1 of 3 elements"):
        assert_close(torch.tensor([1.0, float("nan"), 1.0]).double(), values)


def test_assert_close_up_to_sign_flips_whole_vectors_only():
    generator = torch.Generator().manual_seed(1)
    vectors = torch.linalg.qr(
        torch.randn(5, 3, generator=generator, dtype=torch.float64)
    ).Q
    flipped = vectors * torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    assert_close_up_to_sign(flipped, vectors, dim=-1)
    assert_close_up_to_sign(flipped.T, vectors.T, dim=0)
    partly_flipped = vectors.clone()
    partly_flipped[0, 1] *= -1
    with pytest.raises(AssertionError, match="sign-aligned"):
        assert_close_up_to_sign(partly_flipped, vectors, dim=-1)


def test_assert_close_with_direction_signs_requires_consistent_signs():
    generator = torch.Generator().manual_seed(2)
    directions = torch.linalg.qr(
        torch.randn(5, 2, generator=generator, dtype=torch.float64)
    ).Q
    grads = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    signs = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    assert_close_with_direction_signs(
        grads @ (directions * signs),
        grads @ directions,
        actual_directions=directions * signs,
        expected_directions=directions,
    )
    with pytest.raises(AssertionError):
        assert_close_with_direction_signs(
            grads @ (directions * signs),
            grads @ directions,
            actual_directions=directions,
            expected_directions=directions,
        )
