"""Faults in the middle of training: a NaN batch, a raising closure, a bad state dict.

Each fault is followed by more training, compared exactly with a run that never met
the fault: the fault must leave parameters and optimizer state as they were.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from dampednewton import DampedNewton
from dampednewton._step.checkpoint import StateDictError
from tests.cases import PROBLEMS
from tests.utils import (
    Case,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    make_closure,
    saved_counters,
    snapshot,
)

MLP_CE = PROBLEMS[0]
STEPS = 6
FAULT_AT = 3  # a refresh of the ramp (0, 1, 3, 7): the autograd pass's


class DataLoaderError(RuntimeError):
    """What a closure whose data loading fails raises."""


def batches(case: Case) -> list[tuple[Tensor, Tensor]]:
    """``STEPS`` overlapping mini-batches of the case's data."""
    size = case.X.shape[0] // 2
    return [
        (case.X.roll(shift, 0)[:size], case.y.roll(shift, 0)[:size])
        for shift in range(STEPS)
    ]


def optimizer_for(case: Case) -> DampedNewton:
    """The defaults (Monte-Carlo GGN, averaging, Levenberg-Marquardt), skipping."""
    return DampedNewton(case.model.parameters(), nonfinite="skip", seed=0)


def train(case: Case, optimizer: DampedNewton, data: list[tuple[Tensor, Tensor]]):
    for X, y in data:
        optimizer.step(make_closure(optimizer, case.model, case.loss_fn, X, y))


def undisturbed() -> tuple[Case, DampedNewton]:
    """The run that never met a fault."""
    case = build_case(MLP_CE)
    optimizer = optimizer_for(case)
    train(case, optimizer, batches(case))
    return case, optimizer


def assert_same_run(case: Case, optimizer: DampedNewton, skipped: int) -> None:
    expected_case, expected_optimizer = undisturbed()
    assert_parameters_equal(
        list(case.model.parameters()), list(expected_case.model.parameters())
    )
    expected = snapshot(expected_optimizer)
    saved_counters(expected)["skipped_steps"] += skipped
    assert_same_state(snapshot(optimizer), expected)


def test_nan_batch_in_training_is_skipped_and_training_goes_on_unchanged():
    case = build_case(MLP_CE)
    optimizer = optimizer_for(case)
    data = batches(case)
    train(case, optimizer, data[:FAULT_AT])
    X, y = data[FAULT_AT]
    poisoned = X.clone()
    poisoned[0, 0] = float("nan")

    with pytest.warns(RuntimeWarning, match="refused the update"):
        train(case, optimizer, [(poisoned, y)])
    train(case, optimizer, data[FAULT_AT:])

    assert_same_run(case, optimizer, skipped=1)


@pytest.mark.parametrize("after_backward", [False, True], ids=["forward", "backward"])
def test_raising_closure_propagates_and_training_goes_on_unchanged(
    after_backward: bool,
):
    case = build_case(MLP_CE)
    optimizer = optimizer_for(case)
    data = batches(case)
    train(case, optimizer, data[:FAULT_AT])
    X, y = data[FAULT_AT]

    def failing_closure() -> Tensor:
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(X), y)
        if after_backward:
            loss.backward()
        raise DataLoaderError("the next batch could not be read")

    params = [p.detach().clone() for p in case.model.parameters()]
    before = snapshot(optimizer)
    with pytest.raises(DataLoaderError, match="could not be read"):
        optimizer.step(failing_closure)
    assert_parameters_equal(list(case.model.parameters()), params)
    assert_same_state(snapshot(optimizer), before)
    train(case, optimizer, data[FAULT_AT:])

    assert_same_run(case, optimizer, skipped=0)


def _adam_state(case: Case) -> dict:
    adam = torch.optim.Adam(case.model.parameters())
    case.loss_fn(case.model(case.X), case.y).backward()
    adam.step()
    return adam.state_dict()


def _two_groups(saved: dict) -> dict:
    saved["param_groups"] = saved["param_groups"] * 2
    return saved


def _without_group_key(saved: dict) -> dict:
    del saved["param_groups"][0]["damping"]
    return saved


def _without_counters(saved: dict) -> dict:
    del saved_counters(saved)["step"]
    return saved


def _without_state(saved: dict) -> dict:
    del saved["state"]
    return saved


def _foreign_parameter_state(saved: dict) -> dict:
    saved["state"][0] = {"exp_avg": torch.zeros(1)}
    return saved


def _another_models_momentum(saved: dict) -> dict:
    buffer = saved["state"][0]["momentum_buffer"]
    saved["state"][0]["momentum_buffer"] = torch.zeros(buffer.shape[0] + 1, 2)
    return saved


def _another_models_factor(saved: dict) -> dict:
    size = saved["state"][0]["kronecker_output_factor"].shape[0] + 1
    saved["state"][0]["kronecker_output_factor"] = torch.eye(size)
    return saved


def _missing_parameter(saved: dict) -> dict:
    saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:-1]
    return saved


BAD_STATE_DICTS = {
    "two-groups": (_two_groups, "2 parameter group"),
    "missing-setting": (_without_group_key, r"lacks the setting\(s\) \['damping'\]"),
    "missing-counters": (_without_counters, "step counters .* integers 'step'"),
    "missing-state": (_without_state, r"lacks the key\(s\) \['state'\]"),
    "foreign-parameter-state": (_foreign_parameter_state, r"\['exp_avg'\]"),
    "missing-parameter": (_missing_parameter, "group 0 has 3 parameters"),
    "another-models-momentum": (_another_models_momentum, "the state dict of another"),
    "another-models-factor": (_another_models_factor, "the state dict of another"),
}


def _assert_refused_and_usable(saved: dict, match: str) -> None:
    case = build_case(MLP_CE)
    optimizer = optimizer_for(case)
    data = batches(case)
    train(case, optimizer, data[:FAULT_AT])
    before = snapshot(optimizer)

    with pytest.raises(StateDictError, match=match):
        optimizer.load_state_dict(saved)

    assert_same_state(snapshot(optimizer), before)
    train(case, optimizer, data[FAULT_AT:])
    assert_same_run(case, optimizer, skipped=0)


@pytest.mark.parametrize(
    ("corrupt", "match"), BAD_STATE_DICTS.values(), ids=BAD_STATE_DICTS.keys()
)
def test_corrupted_state_dict_is_refused_and_the_optimizer_stays_usable(
    corrupt, match: str
):
    _, source = undisturbed()
    _assert_refused_and_usable(corrupt(copy.deepcopy(source.state_dict())), match)


def test_adams_state_dict_is_refused_and_the_optimizer_stays_usable():
    adam = _adam_state(build_case(MLP_CE))
    _assert_refused_and_usable(adam, r"another optimizer \(e.g. Adam's\)")
