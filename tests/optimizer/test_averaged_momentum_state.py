"""The averaged factor and the momentum survive a checkpoint and a refused step."""

from __future__ import annotations

import pytest
import torch

from dampednewton import CurvatureAveraging, DampedNewton
from tests.cases import PROBLEMS
from tests.utils import (
    assert_same_state,
    build_case,
    copy_parameters,
    flat,
    make_closure,
    snapshot,
)

PROBLEM = {problem.id: problem for problem in PROBLEMS}


def test_averaged_momentum_state_round_trips(tmp_path):
    """Factor, weights and momentum survive torch.save/load: lock-step afterwards."""
    settings = {
        "damping": 0.5,
        "criterion": 2,
        "averaging": CurvatureAveraging(decay=0.9, rank=4, interval=2, ramp=False),
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 0.01,
        "kl_clip": 0.1,
        "mc_samples": 1,
        "seed": 3,
        "warn_small_eigvals": 0,
    }
    case = build_case(PROBLEM["mlp-ce"])
    optimizer = DampedNewton(case.model.parameters(), **settings)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(3):
        optimizer.step(closure)
    path = tmp_path / "state.pt"
    torch.save(optimizer.state_dict(), path)

    twin = build_case(PROBLEM["mlp-ce"])
    copy_parameters(twin.model, case.model)
    resumed = DampedNewton(twin.model.parameters(), **settings)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    twin_closure = make_closure(resumed, twin.model, twin.loss_fn, twin.X, twin.y)
    for _ in range(3):
        optimizer.step(closure)
        resumed.step(twin_closure)
        assert torch.equal(flat(case.model.parameters()), flat(twin.model.parameters()))
    assert resumed.records["groups"][0]["curvature_updates"] == 3  # steps 0, 2, 4


def test_refused_step_keeps_factor_and_momentum():
    """A NaN loss on an averaged, momentum step leaves every state entry unchanged."""
    case = build_case(PROBLEM["mlp-ce"])
    optimizer = DampedNewton(
        case.model.parameters(),
        damping=0.5,
        criterion=2,
        averaging=CurvatureAveraging(rank=3),
        mc_samples=0,
        momentum=0.5,
        warn_small_eigvals=0,
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    saved = snapshot(optimizer)
    values = [p.detach().clone() for p in case.model.parameters()]
    bad_inputs = case.X.clone()
    bad_inputs[0] = torch.nan
    with pytest.raises(FloatingPointError, match="parameters unchanged"):
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, bad_inputs, case.y)
        )
    for param, value in zip(case.model.parameters(), values, strict=True):
        assert torch.equal(param, value)
    assert_same_state(snapshot(optimizer), saved)
