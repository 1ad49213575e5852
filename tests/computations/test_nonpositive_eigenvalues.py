"""ViViT's keep-all criterion on a rank-deficient GGN, vs. explicit-GGN references.

ViViT documents ``lambda evals: list(range(evals.numel()))`` as a criterion. On a
cross-entropy GGN (rank ≤ N·(C−1)) it selects eigenvalues that are zero up to round-off
or negative: the computations warn, return unit eigenvectors (normalised by their
actual norm, as ViViT does), finite derivatives, and steps that leave those directions
out (coefficient zero), never NaN.
"""

from __future__ import annotations

import pytest
import torch
from backpack import backpack, extend
from torch import Tensor, nn

from dampednewton import (
    DampedNewton,
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    SmallestCurvature,
    TopK,
)
from dampednewton.policies.criteria import numerical_zero
from tests import reference
from tests.assertions import assert_close
from tests.cases import PROBLEMS
from tests.utils import (
    EXACT_VIVIT_STEP,
    assert_eigenpairs,
    build_case,
    flat,
    flat_evecs,
    make_closure,
    make_groups,
    reference_block,
    run_backward,
)
from tests.utils import reference_step as optimizer_reference_step

# N=4, C=3, D=39: the 12×12 Gram matrix has at least 4 zero eigenvalues.
MLP_CE = next(problem for problem in PROBLEMS if problem.id == "mlp-ce")
ROUNDOFF_WARNING = "zero up to round-off or negative"


def keep_all(evals: Tensor) -> list[int]:
    """ViViT's documented criterion: every Gram eigenvalue."""
    return list(range(evals.numel()))


def numerically_positive(evals: Tensor) -> list[int]:
    """The eigenvalues above the round-off level ``n·ε·λ_max``."""
    return torch.nonzero(evals > numerical_zero(evals)).flatten().tolist()


def run_keep_all(computation, case, groups: list[dict]) -> None:
    """A backward pass that must warn about the non-positive eigenvalues."""
    with pytest.warns(UserWarning, match=ROUNDOFF_WARNING):
        run_backward(computation, case, groups)


def test_eigh_keep_all_returns_unit_eigenvectors(block_structure):
    case = build_case(MLP_CE)
    groups = make_groups(case.model, block_structure, criterion=keep_all)
    computation = EighComputation()
    run_keep_all(computation, case, groups)
    for group in groups:
        G, _, _ = reference_block(case, group["params"], None, None)
        evals, evecs = computation.get_result(group)
        evecs = flat_evecs(evecs)
        positive = evals > numerical_zero(evals)
        assert not positive.all(), "the block should have zero Gram eigenvalues"
        norms = evecs.norm(dim=0)
        assert_close(norms, torch.ones_like(norms), atol=1e-12, name="‖e_k‖")
        # Vs. the brute-force eigenpairs (up to sign), where λ > 0.
        assert_eigenpairs(G, evals[positive], evecs[:, positive])


def test_eigenvectors_have_unit_norm_in_float32(problem, block_structure):
    """Normalising by the actual norm, not ``√λ``: unit norm to a few ε at any λ.

    Measured over these problems: at most 1.6e-7 (1.4 ε); dividing by ``√λ`` gave up
    to 6.6e-4 at ``λ ≈ 5e-6``.
    """
    case = build_case(problem, torch.float32)
    groups = make_groups(case.model, block_structure, criterion=TopK(1000))
    computation = EighComputation(warn_small_eigvals=0)
    run_backward(computation, case, groups)
    for group in groups:
        norms = flat_evecs(computation.get_result(group)[1]).double().norm(dim=0)
        eps = torch.finfo(torch.float32).eps
        assert_close(norms, torch.ones_like(norms), atol=8 * eps, name="‖e_k‖")


def test_directional_derivatives_keep_all(block_structure):
    case = build_case(MLP_CE)
    groups = make_groups(case.model, block_structure, criterion=keep_all)
    computation = DirectionalDerivativesComputation()
    eigh = EighComputation()
    run_keep_all(computation, case, groups)
    run_keep_all(eigh, case, groups)
    for group in groups:
        _, Gn, grads = reference_block(case, group["params"], None, None)
        gammas, lambdas = computation.get_result(group)
        evals, evecs = eigh.get_result(group)
        evecs = flat_evecs(evecs)
        assert torch.isfinite(gammas).all() and torch.isfinite(lambdas).all()
        assert (lambdas >= 0).all(), "e_kᵀ G_n e_k of a PSD G_n"
        positive = evals > numerical_zero(evals)
        # Along the (unit) eigenvectors of the positive eigenvalues: brute force.
        assert_close(
            gammas[:, positive],
            grads @ evecs[:, positive],
            rtol=1e-7,
            atol=1e-12,
            name="gammas",
        )
        expected = torch.einsum("dk,nde,ek->nk", evecs, Gn, evecs)
        assert_close(
            lambdas[:, positive],
            expected[:, positive],
            rtol=1e-7,
            atol=1e-12,
            name="lambdas",
        )


@pytest.mark.parametrize("damping", [0.0, 0.1], ids=["undamped", "damped"])
def test_damped_newton_keep_all_is_restricted_to_positive(block_structure, damping):
    case = build_case(MLP_CE)
    keep = make_groups(case.model, block_structure, criterion=keep_all, damping=damping)
    restricted = make_groups(
        case.model, block_structure, criterion=numerically_positive, damping=damping
    )
    computation = DirectionalDampedNewtonComputation()
    run_keep_all(computation, case, keep)
    steps = [computation.get_details(group) for group in keep]
    computation = DirectionalDampedNewtonComputation()
    run_backward(computation, case, restricted)
    for group, details in zip(restricted, steps, strict=True):
        positive = details.evals > numerical_zero(details.evals)
        assert not positive.all(), "the block should have zero Gram eigenvalues"
        assert (details.coefficients[~positive] == 0).all()
        assert all(torch.isfinite(s).all() for s in details.step)
        expected = computation.get_result(group)
        assert_close(
            reference.flatten(details.step),
            reference.flatten(expected),
            rtol=1e-10,
            atol=1e-14,
            name="step",
        )
        # And the brute-force step along the GGN's positive eigenvalues.
        G, Gn, grads = reference_block(case, group["params"], None, None)
        k = int(positive.sum())
        brute_force = reference.damped_newton_step(
            G, Gn, grads, k, torch.full((k,), damping, dtype=G.dtype)
        )
        assert_close(
            reference.flatten(details.step),
            brute_force,
            rtol=1e-7,
            atol=1e-12,
            name="step vs brute force",
        )


def test_vanishing_square_root_gives_zero_directions():
    """Zero inputs and no bias: ``V = 0``, so every ``V ũ_k`` vanishes exactly.

    There is nothing to normalise: eigenvectors and the step are zero, not NaN.
    """
    model = extend(nn.Linear(3, 2, bias=False).double())
    loss_fn = extend(nn.CrossEntropyLoss())
    X, y = torch.zeros(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])
    group = {"params": list(model.parameters()), "criterion": keep_all, "damping": 0}
    eigh, newton = EighComputation(), DirectionalDampedNewtonComputation()
    for computation in (eigh, newton):
        hook = computation.get_extension_hook([group])
        with (
            pytest.warns(UserWarning, match=ROUNDOFF_WARNING),
            backpack(*computation.get_extensions(), extension_hook=hook),
        ):
            loss_fn(model(X), y).backward()
    evals, evecs = eigh.get_result(group)
    assert (evals == 0).all()
    assert all((v == 0).all() for v in evecs)
    assert all((s == 0).all() for s in newton.get_result(group))


@pytest.mark.parametrize(
    "complement", [None, SmallestCurvature()], ids=["vivit", "complement"]
)
def test_optimizer_keep_all_steps_along_positive_eigenvalues(complement):
    case = build_case(MLP_CE)
    params = list(case.model.parameters())
    before = [p.detach().clone() for p in params]
    optimizer = DampedNewton(
        params,
        damping=0.1,
        criterion=keep_all,
        **{**EXACT_VIVIT_STEP, "complement": complement},
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    with pytest.warns(UserWarning, match=ROUNDOFF_WARNING):
        optimizer.step(closure)
    change = flat([p - b for p, b in zip(params, before, strict=True)])
    assert torch.isfinite(change).all()
    # The brute-force step along every positive eigenvalue of the explicit GGN.
    expected = optimizer_reference_step(
        case.reference_model,
        case.reference_loss_fn,
        list(case.reference_model.parameters()),
        case.X,
        case.y,
        criterion=case.X.shape[0] * 3,
        damping=0.1,
        complement=complement,
    ).step
    assert_close(change, expected, rtol=1e-7, atol=1e-12, name="step")
