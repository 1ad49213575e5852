"""Short training runs: a large loss decrease, and Newton's method on a quadratic."""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from torch import Tensor, nn

from dampednewton import DampedNewton, EigenvalueThreshold
from tests.assertions import assert_close
from tests.cases import LINEAR_MSE, Problem
from tests.utils import EXACT_VIVIT_STEP, build_case, flat, make_closure, seeded

NUM_STEPS = 24
MIN_DECREASE = 10.0
ROUNDOFF_TOL = 1e-11
"""float64 round-off of the Newton step, eps·κ with the condition number κ ≤ 400 of
the normal equations here (≈ 1e-13), with a margin of 100."""


def separable_blobs(generator: torch.Generator, num_samples: int = 16):
    """Two Gaussian blobs in 2d, centred at ±(1.5, 1), with standard deviation 0.5."""
    y = torch.randint(0, 2, (num_samples,), generator=generator)
    centres = (2.0 * y - 1).unsqueeze(1) * torch.tensor([1.5, 1.0])
    X = centres + 0.5 * torch.randn(num_samples, 2, generator=generator)
    return X.double(), y


def test_training_reduces_loss_by_a_large_factor():
    generator = torch.Generator().manual_seed(0)
    model = extend(
        seeded(
            lambda: nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2)),
            generator,
        )
    )
    loss_fn = extend(nn.CrossEntropyLoss())
    X, y = separable_blobs(generator)
    optimizer = DampedNewton(
        model.parameters(), damping=1.0, criterion=4, **EXACT_VIVIT_STEP
    )
    closure = make_closure(optimizer, model, loss_fn, X, y)

    losses = [optimizer.step(closure).item() for _ in range(NUM_STEPS)]
    final = loss_fn(model(X), y).item()

    assert final * MIN_DECREASE <= losses[0], (
        f"loss decreased only from {losses[0]:.3e} to {final:.3e} in {NUM_STEPS} steps"
    )
    assert optimizer.records["global"] == {"step": NUM_STEPS, "skipped_steps": 0}


def _overdetermined_data(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    X = torch.randn(20, 3, generator=generator).double()
    return X, torch.randn(20, 2, generator=generator).double()


OVERDETERMINED = Problem(
    "linear-mse-overdetermined",
    lambda generator: seeded(lambda: nn.Linear(3, 2), generator),
    nn.MSELoss,
    _overdetermined_data,
    seed=6,
)
"""N=20 samples, 3 inputs, 2 outputs: a unique least-squares solution."""


def with_ones(X: Tensor) -> Tensor:
    """Inputs with a column of ones: ``X Wᵀ + b = [X, 1] [W, b]ᵀ``."""
    return torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], dim=1)


def least_squares_update(weight: Tensor, bias: Tensor, X: Tensor, Y: Tensor):
    """Minimum-norm change of ``(W, b)`` that minimizes ``‖X Wᵀ + b − Y‖``."""
    residual = Y - (X @ weight.T + bias)
    change = torch.linalg.lstsq(with_ones(X), residual, driver="gelsd").solution
    return weight + change[:-1].T, bias + change[-1]


def smallest_curvature(X: Tensor, Y: Tensor) -> float:
    """Smallest non-zero GGN eigenvalue ``2σ_min([X, 1])² / (N·C)`` of the MSE."""
    singular_values = torch.linalg.svdvals(with_ones(X))
    nonzero = singular_values[singular_values > 1e-10 * singular_values[0]]
    return 2 * nonzero.min().item() ** 2 / Y.numel()


@pytest.mark.parametrize("damping", [0.0, 1e-12], ids=["damping=0", "damping=1e-12"])
@pytest.mark.parametrize("problem", [OVERDETERMINED, LINEAR_MSE], ids=lambda p: p.id)
def test_newton_solves_quadratic_in_one_step(problem: Problem, damping: float):
    """MSE of a linear model: GGN = Hessian, so a full Newton step is exact.

    With all non-zero directions and no damping the step is ``−G⁺ g``: it reaches the
    least-squares solution closest to the start (the unique one if overdetermined).
    A damping δ shortens it by the relative amount δ/(λ + δ) ≤ δ/λ_min.
    """
    case = build_case(problem)
    (layer,) = (m for m in case.model.modules() if isinstance(m, nn.Linear))
    params = [layer.weight, layer.bias]
    start = flat(params)
    expected = flat(least_squares_update(*params, case.X, case.y))
    optimizer = DampedNewton(
        params,
        damping=damping,
        criterion=EigenvalueThreshold(1e-8),
        warn_small_eigvals=0,
        **EXACT_VIVIT_STEP,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    # |error| ≤ ‖error‖₂ ≤ round-off + (δ/λ_min)·‖Newton step‖₂
    damping_bias = damping / smallest_curvature(case.X, case.y)
    atol = (
        ROUNDOFF_TOL * expected.abs().max() + damping_bias * (expected - start).norm()
    ).item()

    optimizer.step(closure)

    assert_close(
        flat(params), expected, rtol=ROUNDOFF_TOL, atol=atol, name="one Newton step"
    )
    num_samples, num_outputs = case.y.shape
    assert optimizer.records["groups"][0]["num_directions"] == min(
        num_samples * num_outputs, start.numel()
    )
    # Converged: a second step moves at most by what the damping left over.
    solution = flat(params)
    optimizer.step(closure)
    assert_close(
        flat(params), solution, rtol=ROUNDOFF_TOL, atol=atol, name="second step"
    )
