"""Loss options in the computations, label smoothing, BackPACK's own refusals.

The optimizer's refusals of loss options, on every kind of step:
``test_loss_checks_every_step.py``. Run against real BackPACK: without the checks,
class weights and a non-default ``ignore_index`` fail with BackPACK's generic "cannot
handle module CrossEntropyLoss()", and targets equal to the default ``ignore_index``
give a silently wrong step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from backpack import backpack, extend
from torch import nn

from dampednewton import DampedNewton, EigvalshComputation, GramBasis
from tests.assertions import assert_close
from tests.cases import PROBLEMS
from tests.utils import (
    EXACT_VIVIT_STEP,
    VIVIT_STEP,
    assert_parameters_equal,
    build_case,
    flat,
    make_closure,
    reference_step,
)

MLP_CE, MLP_BCE = PROBLEMS[0], PROBLEMS[2]


def test_computations_name_the_option_too():
    case = build_case(MLP_CE)
    loss_fn = extend(nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.float64)))
    computation = EigvalshComputation()
    hook = computation.get_extension_hook([{"params": list(case.model.parameters())}])
    with (
        pytest.raises(ValueError, match=r"CrossEntropyLoss\(weight=\.\.\.\)"),
        backpack(computation.get_extension(), extension_hook=hook),
    ):
        loss_fn(case.model(case.X), case.y).backward()


@pytest.mark.parametrize("smoothing", [0.1, 0.4])
def test_label_smoothing_step_matches_the_brute_force_step(smoothing: float):
    """The loss Hessian w.r.t. the logits does not depend on the targets."""
    problem = dataclasses.replace(
        MLP_CE,
        id="mlp-ce-smoothing",
        loss=lambda: nn.CrossEntropyLoss(label_smoothing=smoothing),
    )
    case = build_case(problem)
    params = list(case.model.parameters())
    expected = reference_step(
        case.reference_model,
        case.reference_loss_fn,
        case.reference_params(params),
        case.X,
        case.y,
        criterion=3,
        damping=0.5,
    )
    before = flat(params)
    optimizer = DampedNewton(
        params, lr=1.0, damping=0.5, criterion=3, **EXACT_VIVIT_STEP
    )

    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))

    assert_close(flat(params) - before, expected.step, name="step")
    assert_close(
        optimizer.records["groups"][0]["evals"], expected.evals, name="eigenvalues"
    )


def test_other_refusals_of_a_supported_loss_keep_backpacks_reason():
    case = build_case(MLP_BCE)
    optimizer = DampedNewton(case.model.parameters(), mc_samples=1, **VIVIT_STEP)
    soft_targets = torch.full_like(case.y, 0.3)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, soft_targets)

    with pytest.raises(
        NotImplementedError,
        match=r"supports BCEWithLogitsLoss, but not this configuration of it: "
        r"Only binary targets",
    ):
        optimizer.step(closure)


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
@pytest.mark.parametrize("step", [0, 2], ids=["refresh", "between"])
def test_a_closure_returning_several_losses_is_refused(basis, step):
    case = build_case(PROBLEMS[0])
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(case.model.parameters(), seed=0, **options)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(step):
        optimizer.step(closure)
    params = [p.detach().clone() for p in case.model.parameters()]
    with pytest.raises(ValueError, match=r"mean loss, a tensor of one number.*\(2,\)"):
        optimizer.step(lambda: closure().repeat(2))
    assert_parameters_equal(list(case.model.parameters()), params)
