"""Damping policies inside the optimizer: LM adaptation, state round trip."""

from __future__ import annotations

import io

import pytest
import torch

from dampednewton import (
    DampedNewton,
    EigenvalueThreshold,
    GSNRDamping,
    LevenbergMarquardt,
    NoiseAwareDamping,
)
from tests.cases import LINEAR_MSE, PROBLEMS
from tests.utils import EXACT_VIVIT_STEP, build_case, make_closure


def test_levenberg_marquardt_on_a_quadratic_sees_ratio_one():
    """Linear model + MSE: the quadratic model along all directions is exact, ρ = 1."""
    case = build_case(LINEAR_MSE)
    policy = LevenbergMarquardt(value=0.1)
    optimizer = DampedNewton(
        case.model.parameters(),
        lr=0.5,
        damping=policy,
        criterion=EigenvalueThreshold(1e-10),
        **EXACT_VIVIT_STEP,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for step in range(3):
        optimizer.step(closure)
        ratio = optimizer.records["global"]["reduction_ratio"]
        assert ratio == pytest.approx(1.0, rel=1e-9)
        assert policy.value == pytest.approx(0.1 * (2 / 3) ** (step + 1))


def test_levenberg_marquardt_grows_damping_after_a_bad_step():
    """A far too long step on a non-linear problem increases the loss: ρ < 0."""
    case = build_case(PROBLEMS[0])
    policy = LevenbergMarquardt(value=1e-3)
    optimizer = DampedNewton(
        case.model.parameters(), lr=1e3, damping=policy, criterion=2, **EXACT_VIVIT_STEP
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    assert optimizer.records["global"]["reduction_ratio"] < 0.25
    assert policy.value == pytest.approx(1.5e-3)


def test_levenberg_marquardt_interval_skips_the_extra_evaluation():
    case = build_case(LINEAR_MSE)
    calls = []
    optimizer = DampedNewton(
        case.model.parameters(),
        damping=LevenbergMarquardt(value=0.1, interval=3),
        criterion=EigenvalueThreshold(1e-10),
        **EXACT_VIVIT_STEP,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)

    def counting_closure():
        calls.append(1)
        return closure()

    for _ in range(3):
        optimizer.step(counting_closure)
    assert len(calls) == 4  # three steps + one extra evaluation on the 3rd update


@pytest.mark.parametrize(
    "policy",
    [LevenbergMarquardt(value=0.5), NoiseAwareDamping(1e-2, 1.0), GSNRDamping(1e-2)],
    ids=lambda p: type(p).__name__,
)
def test_policy_state_round_trips_through_state_dict(policy):
    case = build_case(PROBLEMS[0])
    optimizer = DampedNewton(
        case.model.parameters(), damping=policy, criterion=2, **EXACT_VIVIT_STEP
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    other = DampedNewton(
        case.model.parameters(), damping=0.0, criterion=2, **EXACT_VIVIT_STEP
    )
    other.load_state_dict(torch.load(buffer))
    assert other.param_groups[0]["damping"] == optimizer.param_groups[0]["damping"]
    assert other.param_groups[0]["damping"] is not optimizer.param_groups[0]["damping"]
