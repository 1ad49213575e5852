"""Groups without directions, groups added later, grad mode, and the docstring."""

from __future__ import annotations

import doctest
import warnings
from pathlib import Path

import pytest
import torch

import dampednewton.optimizer
from dampednewton import DampedNewton, EigenvalueThreshold
from tests.cases import PROBLEMS
from tests.utils import (
    EXACT_VIVIT_STEP,
    assert_parameters_equal,
    build_case,
    make_closure,
)

MLP_CE = PROBLEMS[0]


def test_group_without_direction_does_not_move_and_warns_once():
    case = build_case(MLP_CE)
    first, second = (list(layer.parameters()) for layer in case.model[::2])
    optimizer = DampedNewton(
        [{"params": first}, {"params": second, "criterion": EigenvalueThreshold(1e6)}],
        damping=1.0,
        criterion=2,
        **EXACT_VIVIT_STEP,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    frozen = [p.detach().clone() for p in second]
    moving = [p.detach().clone() for p in first]

    with pytest.warns(UserWarning, match="group 1 selected no direction") as record:
        optimizer.step(closure)
    with warnings.catch_warnings(record=True) as second_record:
        warnings.simplefilter("always")
        optimizer.step(closure)

    no_direction = [r for r in record if "no direction" in str(r.message)]
    assert [Path(r.filename) for r in no_direction] == [Path(__file__)]
    assert not [r for r in second_record if "no direction" in str(r.message)]
    assert_parameters_equal(second, frozen)
    assert all(not torch.equal(p, v) for p, v in zip(first, moving, strict=True))
    stats = optimizer.records["groups"]
    assert stats[1]["num_directions"] == 0
    assert stats[1]["steps_without_direction"] == 2
    assert stats[0]["num_directions"] == 2
    assert stats[0]["steps_without_direction"] == 0
    assert optimizer.records["global"] == {"step": 2, "skipped_steps": 0}


def test_group_added_later_is_stepped_and_logged():
    case = build_case(MLP_CE)
    first, second = (list(layer.parameters()) for layer in case.model[::2])
    optimizer = DampedNewton(first, damping=1.0, criterion=2, **EXACT_VIVIT_STEP)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    optimizer.step(closure)
    optimizer.add_param_group({"params": second, "lr": 0.5, "criterion": 3})
    values = [p.detach().clone() for p in second]

    optimizer.step(closure)

    assert optimizer.param_groups[1]["lr"] == 0.5
    assert optimizer.param_groups[1]["damping"] == 1.0  # default filled in
    assert all(not torch.equal(p, v) for p, v in zip(second, values, strict=True))
    assert [s["num_directions"] for s in optimizer.records["groups"]] == [2, 3]


def test_shared_settings_compare_by_value():
    """Sub-sampling indices as a tuple or a list are the same setting."""
    case = build_case(MLP_CE)
    first, second = (list(layer.parameters()) for layer in case.model[::2])
    optimizer = DampedNewton(
        first, criterion=2, subsampling_ggn=[0, 2], **EXACT_VIVIT_STEP
    )
    optimizer.add_param_group({"params": second, "subsampling_ggn": (0, 2)})
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    assert optimizer.records["global"]["step"] == 1


def test_step_enables_grad_itself():
    """Inside ``torch.no_grad()`` the step is the same as outside."""
    params = []
    for grad_mode in (torch.enable_grad, torch.no_grad):
        case = build_case(MLP_CE)
        optimizer = DampedNewton(
            case.model.parameters(), damping=1.0, criterion=2, **EXACT_VIVIT_STEP
        )
        closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        with grad_mode():
            optimizer.step(closure)
        params.append(list(case.model.parameters()))
    assert_parameters_equal(params[1], params[0])


def test_docstring_example():
    result = doctest.testmod(dampednewton.optimizer, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0
