"""Complement policies and the complement's curvature, against direct formulas."""

from __future__ import annotations

import io
import math

import pytest
import torch

from dampednewton import ConstantCurvature, MeasuredCurvature, SmallestCurvature
from dampednewton.math.complement import complement_rayleigh_quotient

LAMBDAS = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)
DAMPING = torch.tensor([0.3, 0.1, 0.0], dtype=torch.float64)
"""Damped curvatures 0.8, 2.1, 4.0: direction 0 is the flattest kept one."""


@pytest.mark.parametrize(
    ("measured", "expected"),
    [(None, 0.8), (0.2, 0.8), (0.5, 0.8), (1.5, 1.8), (10.0, 10.3)],
    ids=["not-measured", "flatter", "equal", "steeper", "much-steeper"],
)
def test_measured_curvature_raises_rho_to_the_complement(measured, expected):
    """``ρ = max(λ̄_j, q_⊥) + δ_j`` with ``j`` the flattest damped direction."""
    q = None if measured is None else torch.tensor(measured, dtype=torch.float64)

    rho = MeasuredCurvature()(LAMBDAS, DAMPING, q)

    assert rho.item() == pytest.approx(expected, rel=1e-15)


def test_measured_curvature_skips_non_finite_directions():
    """An infinitely damped direction is never the flattest one."""
    lambdas = torch.tensor([0.1, 3.0], dtype=torch.float64)
    damping = torch.tensor([torch.inf, 0.5], dtype=torch.float64)

    rho = MeasuredCurvature()(lambdas, damping, torch.tensor(1.0))

    assert rho.item() == 3.5


@pytest.mark.parametrize(
    "policy", [SmallestCurvature(), MeasuredCurvature()], ids=lambda p: type(p).__name__
)
def test_no_direction_no_complement(policy):
    """Without kept directions there is no curvature to borrow: ``ρ = inf``."""
    empty = torch.zeros(0, dtype=torch.float64)
    dropped = torch.full((2,), torch.inf, dtype=torch.float64)

    assert policy(empty, empty, torch.tensor(1.0)).item() == math.inf
    assert policy(LAMBDAS[:2], dropped, torch.tensor(1.0)).item() == math.inf


def test_other_policies_ignore_the_measurement():
    """Only :class:`MeasuredCurvature` looks at ``q_⊥``."""
    q = torch.tensor(100.0, dtype=torch.float64)

    assert SmallestCurvature()(LAMBDAS, DAMPING, q).item() == pytest.approx(0.8)
    assert ConstantCurvature(0.7)(LAMBDAS, DAMPING, q).item() == 0.7


def test_rayleigh_quotient_matches_explicit_ggn():
    """``‖Vᵀg_⊥‖²/‖g_⊥‖² = g_⊥ᵀ(VVᵀ)g_⊥/‖g_⊥‖²`` for a random square root ``V``."""
    generator = torch.Generator().manual_seed(0)
    V = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    orthogonal = torch.randn(7, generator=generator, dtype=torch.float64)
    expected = orthogonal @ (V @ V.T) @ orthogonal / (orthogonal @ orthogonal)

    q = complement_rayleigh_quotient(V.T @ orthogonal, orthogonal @ orthogonal)

    assert q.item() == pytest.approx(expected.item(), rel=1e-14)


def test_rayleigh_quotient_of_no_complement_is_zero():
    """A gradient inside the kept directions has no complement: ``q_⊥ = 0``."""
    zero = torch.zeros((), dtype=torch.float64)

    assert complement_rayleigh_quotient(torch.zeros(3), zero).item() == 0.0


def test_measured_curvature_survives_weights_only_load():
    """Policies live in param groups: ``torch.load(weights_only=True)`` restores it."""
    buffer = io.BytesIO()
    torch.save({"complement": MeasuredCurvature()}, buffer)
    buffer.seek(0)

    assert torch.load(buffer, weights_only=True)["complement"] == MeasuredCurvature()
