"""Self-tests of the brute-force references: conventions, flattening, derivatives.

Per-sample losses, gradients, Jacobians and loss Hessians against BackPACK and
closed forms.
"""

from __future__ import annotations

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad, SqrtGGNExact
from torch import Tensor, nn

from dampednewton.backpack.added_modules import use_added_modules
from dampednewton.backpack.extensions import ExactSqrtGGN
from tests import reference
from tests.assertions import assert_close
from tests.cases import CASES, PROBLEMS
from tests.utils import full_group

ALL_PROBLEMS = CASES
ALL_IDS = [problem.id for problem in ALL_PROBLEMS]

parametrize_problems = pytest.mark.parametrize(
    "problem", PROBLEMS, ids=[problem.id for problem in PROBLEMS]
)
parametrize_all_problems = pytest.mark.parametrize("problem", ALL_PROBLEMS, ids=ALL_IDS)


@parametrize_all_problems
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_references_follow_backpack_conventions(problem):
    model, loss_fn, params, X, y = full_group(problem)
    expected_ggn = reference.ggn(model, loss_fn, params, X, y)
    expected_grads = reference.per_sample_gradients(model, loss_fn, params, X, y)

    model, loss_fn = extend(model), extend(loss_fn)
    # BackPACK's own derivatives refuse multi-label binary cross-entropy, which
    # the package's loss derivatives take (equal to BackPACK's where it has them).
    multilabel = "multilabel" in problem.id
    sqrt_extension = ExactSqrtGGN() if multilabel else SqrtGGNExact()
    use_added_modules(sqrt_extension)  # GELU, SiLU, ...: the package's derivatives
    with backpack(sqrt_extension, BatchGrad()):
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
    model, loss_fn, params, X, y = full_group(PROBLEMS[0])
    with pytest.raises(ValueError, match="not parameters of the model"):
        reference.ggn(model, loss_fn, [nn.Parameter(torch.zeros(2))], X, y)
    with pytest.raises(ValueError, match="more than once"):
        reference.ggn(model, loss_fn, [params[0], params[0]], X, y)
    with pytest.raises(ValueError, match="empty"):
        reference.per_sample_gradients(model, loss_fn, [], X, y)


# Losses, gradients, Jacobians


@parametrize_all_problems
def test_per_sample_losses_average_to_batch_loss(problem):
    model, loss_fn, _, X, y = full_group(problem)
    outputs = model(X)
    assert_close(
        reference.per_sample_losses(loss_fn, outputs, y).mean(),
        loss_fn(outputs, y),
        name="mean per-sample loss",
    )


@parametrize_all_problems
def test_mean_per_sample_gradient_is_gradient_of_mean_loss(problem):
    model, loss_fn, params, X, y = full_group(problem)
    expected = reference.flatten(torch.autograd.grad(loss_fn(model(X), y), params))
    grads = reference.per_sample_gradients(model, loss_fn, params, X, y)
    assert_close(grads.mean(0), expected, name="mean per-sample gradient")


@parametrize_all_problems
def test_per_sample_gradient_is_jacobian_transpose_output_gradient(problem):
    model, loss_fn, params, X, y = full_group(problem)
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
    model, _, params, X, _ = full_group(problem)
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
