"""Keys of the param groups besides the hyperparameters, and groups added later.

As in ``torch.optim``, a group may carry keys the optimizer does not read (a
layer-wise learning-rate scale another tool reads): they stay, with a warning that
catches a misspelt hyperparameter. A group added after a load or a copy gets what it
would have got without them.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import warnings

import pytest
import torch

from dampednewton import DampedNewton, GramBasis
from tests.cases import PROBLEMS
from tests.utils import (
    assert_parameters_equal,
    assert_same_state,
    build_case,
    run_steps,
    snapshot,
)

MLP_CE = PROBLEMS[0]


def test_keys_that_are_no_hyperparameter_warn_and_stay_through_a_checkpoint():
    case = build_case(MLP_CE)
    first, _, last = case.model
    groups = [
        {"params": first.parameters(), "lr_scale": 0.5},
        {"params": last.parameters(), "betas": (0.9, 0.99)},
    ]
    with pytest.warns(UserWarning, match=r"\['lr_scale'\] in parameter group 0"):
        optimizer = DampedNewton(groups, seed=0)
    run_steps(optimizer, case, 2)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    twin = build_case(MLP_CE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        resumed = DampedNewton(
            [
                {"params": twin.model[0].parameters(), "lr_scale": 0.5},
                {"params": twin.model[2].parameters(), "betas": (0.9, 0.99)},
            ],
            seed=0,
        )
    twin.model.load_state_dict(case.model.state_dict())
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert [g.get("lr_scale") for g in resumed.param_groups] == [0.5, None]
    run_steps(optimizer, case, 3)
    run_steps(resumed, twin, 3)
    assert_parameters_equal(
        list(twin.model.parameters()), list(case.model.parameters())
    )


def test_a_misspelt_hyperparameter_added_later_warns():
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model[0].parameters())
    with pytest.warns(
        UserWarning, match=r"\['dampng'\] in parameter group 1.*misspelt"
    ):
        optimizer.add_param_group({"params": case.model[2].parameters(), "dampng": 1})


@pytest.mark.parametrize("how", ["load", "deepcopy"])
def test_a_group_added_after_a_load_or_copy_shares_the_adapted_damping(how):
    """A group added later takes the default damping object, adapted so far.

    The Gram basis' default Levenberg-Marquardt object adapts for every group that
    takes the default; the resumed run continues so.
    """
    case = build_case(MLP_CE)
    first, _, last = case.model
    optimizer = DampedNewton(first.parameters(), basis=GramBasis(), seed=0)
    run_steps(optimizer, case, 6)
    if how == "load":
        twin = build_case(MLP_CE)
        twin.model.load_state_dict(case.model.state_dict())
        resumed = DampedNewton(twin.model[0].parameters(), basis=GramBasis(), seed=0)
        resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    else:
        model, resumed = copy.deepcopy((case.model, optimizer))
        twin = dataclasses.replace(case, model=model)
    optimizer.add_param_group({"params": last.parameters()})
    resumed.add_param_group({"params": twin.model[2].parameters()})
    for opt in (optimizer, resumed):
        assert opt.param_groups[1]["damping"] is opt.param_groups[0]["damping"]
        assert "differentiable" not in opt.param_groups[1]
    run_steps(optimizer, case, 10)
    run_steps(resumed, twin, 10)
    assert_parameters_equal(
        list(twin.model.parameters()), list(case.model.parameters())
    )
    reloaded = DampedNewton(
        [
            {"params": twin.model[0].parameters()},
            {"params": twin.model[2].parameters()},
        ],
        basis=GramBasis(),
    )
    reloaded.load_state_dict(resumed.state_dict())
    assert_same_state(snapshot(reloaded), snapshot(resumed))


def test_a_checkpoint_loads_into_groups_with_more_keys_as_in_torch():
    """E.g. a scheduler's ``initial_lr`` or a user's key set before the load."""
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), seed=0)
    run_steps(optimizer, case, 2)
    target = DampedNewton(build_case(MLP_CE).model.parameters(), seed=1)
    torch.optim.lr_scheduler.StepLR(target, step_size=5)  # writes initial_lr
    target.param_groups[0]["lr_scale"] = 0.5
    target.load_state_dict(optimizer.state_dict())
    sgd = torch.optim.SGD(build_case(MLP_CE).model.parameters(), lr=0.1)
    sgd.param_groups[0]["lr_scale"] = 0.5
    sgd.load_state_dict(torch.optim.SGD(case.model.parameters(), lr=0.1).state_dict())
    # As in torch, the saved groups replace the optimizer's.
    assert "lr_scale" not in sgd.param_groups[0]
    assert "lr_scale" not in target.param_groups[0]
    assert target.records["global"]["step"] == 2
