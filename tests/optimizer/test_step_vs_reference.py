"""One ``DampedNewton`` step equals lr × the brute-force float64 damped Newton step.

Every group has its own lr, damping, criterion and Newton fraction, given in all
accepted forms: shorthands (int ``k``, float damping), the picklable built-in
policies, and ViViT-style callables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from dampednewton import (
    ConstantCurvature,
    ConstantDamping,
    DampedNewton,
    EigenvalueThreshold,
    GramBasis,
    MeasuredCurvature,
    RelativeThreshold,
    SmallestCurvature,
    TopK,
)
from tests.assertions import assert_close
from tests.cases import PROBLEMS, Problem
from tests.utils import build_case, flat, make_closure, reference_step

PROBLEM = {problem.id: problem for problem in PROBLEMS}
ROUNDOFF_GROWTH = 50
"""Accumulated round-off, in units of eps, of the forward and backward pass, the Gram
and gradient products (sums of at most a few hundred terms, error growth ~√length)
and the small ``eigh``; the measured errors stay below 6 eps·κ."""


def top_two(evals: Tensor) -> list[int]:
    """ViViT-style criterion: the indices of the two largest eigenvalues."""
    return [evals.numel() - 2, evals.numel() - 1]


def noise_damping(evals: Tensor, evecs: Any, gammas: Tensor, lambdas: Tensor):
    """ViViT-style damping from the per-sample slopes and curvatures (sign-free)."""
    return 0.1 * gammas.square().mean(0) + 0.5 * lambdas.std(0)


@dataclass(frozen=True)
class GroupSetting:
    """Hyperparameters of one parameter group."""

    lr: float
    damping: Any
    criterion: Any
    newton_fraction: float = 1.0


SHORTHANDS = GroupSetting(lr=0.5, damping=1.0, criterion=2)
POLICIES = GroupSetting(
    lr=1.0, damping=ConstantDamping(0.1), criterion=TopK(3), newton_fraction=0.3
)
CALLABLES = GroupSetting(lr=2.0, damping=noise_damping, criterion=top_two)
THRESHOLD = GroupSetting(
    lr=0.25, damping=0.01, criterion=EigenvalueThreshold(1e-3), newton_fraction=0.5
)
RELATIVE = GroupSetting(
    lr=1.5, damping=0.05, criterion=RelativeThreshold(0.1), newton_fraction=0.7
)


@dataclass(frozen=True)
class StepCase:
    """A problem split into groups: indices into ``model.parameters()``, settings."""

    id: str
    problem: Problem
    groups: tuple[tuple[tuple[int, ...], GroupSetting], ...]


# The MSE last layer's GGN is Kronecker-factored (every eigenvalue C-fold): only
# thresholds, which select whole eigenspaces, give a well-defined step there.
STEP_CASES = [
    StepCase(
        "mlp-ce/3-groups",
        PROBLEM["mlp-ce"],
        (((0, 1), SHORTHANDS), ((2,), CALLABLES), ((3,), RELATIVE)),
    ),
    StepCase(
        "mlp-mse/layers", PROBLEM["mlp-mse"], (((0, 1), POLICIES), ((2, 3), THRESHOLD))
    ),
    StepCase(
        "mlp-bce/layers",
        PROBLEM["mlp-bce"],
        (((0, 1), CALLABLES), ((2, 3), SHORTHANDS)),
    ),
    StepCase(
        "mlp-bce-multilabel/layers",
        PROBLEM["mlp-bce-multilabel"],
        (((0, 1), POLICIES), ((2, 3), CALLABLES)),
    ),
    StepCase(
        "cnn-ce/layers", PROBLEM["cnn-ce"], (((0, 1), RELATIVE), ((2, 3), POLICIES))
    ),
    StepCase(
        "mlp-ce-wide/weight-bias",
        PROBLEM["mlp-ce-wide"],
        (((0,), THRESHOLD), ((1,), SHORTHANDS)),
    ),
]


COMPLEMENTS = {
    "vivit": None,
    "smallest": SmallestCurvature(),
    "constant": ConstantCurvature(0.7),
    "measured": MeasuredCurvature(),
}


@pytest.mark.parametrize("complement", COMPLEMENTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("spec", STEP_CASES, ids=lambda spec: spec.id)
def test_step_matches_reference(
    spec: StepCase, dtype: torch.dtype, complement: str, device: str
):
    """Per group: ``Δθ = lr · s_ref``, and the logged state matches the reference.

    ``s_ref`` is computed in float64 from the explicit GGN at exactly the values the
    optimizer saw (float32 values are cast up). Round-off of relative size eps in
    the curvature is amplified by at most the condition number
    ``κ = max(1, λ_max / min_k(λ̄_k + δ_k))`` of the damped system on the selected
    directions, so errors are compared to ``ROUNDOFF_GROWTH · eps · κ`` relative to
    the largest step entry. With a complement, ``−(ḡ − E Eᵀ ḡ)/ρ`` joins the step and
    ``ρ`` the condition number's denominator.
    """
    policy = COMPLEMENTS[complement]
    case = build_case(spec.problem, dtype, device)
    params = list(case.model.parameters())
    groups = [
        {
            "params": [params[i] for i in indices],
            "lr": setting.lr,
            "damping": setting.damping,
            "criterion": setting.criterion,
            "newton_fraction": setting.newton_fraction,
            "complement": policy,
        }
        for indices, setting in spec.groups
    ]
    optimizer = DampedNewton(
        groups,
        basis=GramBasis(),
        warn_small_eigvals=0,
        mc_samples=0,
        averaging=None,
        kl_clip=None,
    )
    model64 = case.reference_model.to(torch.float64)
    X64 = case.X.to(torch.float64)
    y64 = case.y.to(torch.float64) if case.y.is_floating_point() else case.y
    reference_params = list(model64.parameters())
    before = [p.detach().clone() for p in params]

    loss = optimizer.step(
        make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    )

    expected_loss = case.reference_loss_fn(model64(X64), y64)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=100 * _eps(dtype))
    assert optimizer.records["global"] == {"step": 1, "skipped_steps": 0}
    for index, (indices, setting) in enumerate(spec.groups):
        ref = reference_step(
            model64,
            case.reference_loss_fn,
            [reference_params[i] for i in indices],
            X64,
            y64,
            setting.criterion,
            setting.damping,
            policy,
            setting.newton_fraction,
        )
        smallest = (ref.lambda_mean + ref.damping).min().item()
        if ref.complement_curvature is not None:
            smallest = min(smallest, ref.complement_curvature)
        kappa = max(1.0, ref.spectrum.max().item() / smallest)
        tol = ROUNDOFF_GROWTH * _eps(dtype) * float(kappa)
        name = f"{spec.id} group {index} ({dtype})"
        expected = setting.lr * ref.step
        assert_close(
            flat([params[i] - before[i] for i in indices]),
            expected,
            rtol=0,
            atol=tol * expected.abs().max().item(),
            name=f"{name}: parameter change",
        )
        stats = optimizer.records["groups"][index]
        assert stats["num_directions"] == ref.evals.numel() > 0
        assert stats["steps_without_direction"] == 0
        scale = ref.spectrum.max().item()
        compared = [
            ("evals", stats["evals"], ref.evals),
            ("lambda_mean", stats["lambda_mean"], ref.lambda_mean),
            ("damping", stats["damping"], ref.damping),
            # Invariant to the choice of eigenvectors within repeated eigenvalues.
            ("‖gamma_mean‖", stats["gamma_mean"].norm(), ref.gamma_mean.norm()),
        ]
        if bool((ref.evals.diff() > 1e-6 * scale).all()):
            # Simple eigenvalues: e_k is unique up to sign, and γ̄_k, c_k flip with it.
            compared += [
                ("|gamma_mean|", stats["gamma_mean"].abs(), ref.gamma_mean.abs()),
                (
                    "|coefficients|",
                    stats["coefficients"].abs(),
                    setting.newton_fraction
                    * (ref.gamma_mean / (ref.lambda_mean + ref.damping)).abs(),
                ),
            ]
        for key, actual, wanted in compared:
            assert_close(
                actual.to(torch.float64),
                wanted,
                rtol=tol,
                atol=tol * wanted.abs().max().item(),
                name=f"{name}: {key}",
            )


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps
