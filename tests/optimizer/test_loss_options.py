"""Loss options BackPACK's GGN cannot handle are refused by name; label smoothing works.

Run against real BackPACK: without the check, class weights and a non-default
``ignore_index`` fail with BackPACK's generic "cannot handle module
CrossEntropyLoss()", and targets equal to the default ``ignore_index`` give a silently
wrong step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from backpack import backpack, extend
from torch import nn

from dampednewton import DampedNewton, EigvalshComputation
from tests.assertions import assert_close
from tests.cases import PROBLEMS
from tests.utils import (
    EXACT_VIVIT_STEP,
    VIVIT_STEP,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    flat,
    make_closure,
    reference_step,
    snapshot,
)

MLP_CE, MLP_BCE = PROBLEMS[0], PROBLEMS[2]
REWEIGHT = r"without weights and rebalance by sampling.*WeightedRandomSampler"
DROP = r"Drop the samples to ignore before the loss.*outputs\[keep\], targets\[keep\]"

REFUSED = {
    "ce-class-weights": (
        MLP_CE,
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0])),
        lambda y: y,
        r"CrossEntropyLoss\(weight=\.\.\.\) is not supported\. .*" + REWEIGHT,
    ),
    "ce-ignore-index-set": (
        MLP_CE,
        lambda: nn.CrossEntropyLoss(ignore_index=7),
        lambda y: y,
        r"ignore_index=7\) is not supported.*only the default "
        r"ignore_index=-100.*" + DROP,
    ),
    "ce-ignore-index-hit": (
        MLP_CE,
        nn.CrossEntropyLoss,
        lambda y: torch.cat([y[:-1], torch.tensor([-100])]),
        r"1 of the 4 targets equal CrossEntropyLoss's ignore_index=-100.*" + DROP,
    ),
    "bce-pos-weight": (
        MLP_BCE,
        lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0])),
        lambda y: y,
        r"BCEWithLogitsLoss\(pos_weight=\.\.\.\) is not supported\. .*" + REWEIGHT,
    ),
    "bce-weight": (
        MLP_BCE,
        lambda: nn.BCEWithLogitsLoss(weight=torch.full((6, 1), 2.0)),
        lambda y: y,
        r"BCEWithLogitsLoss\(weight=\.\.\.\) is not supported\. .*" + REWEIGHT,
    ),
}


@pytest.mark.parametrize("mc_samples", [0, 1], ids=["exact", "monte-carlo"])
@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_loss_option_is_named_and_changes_nothing(
    name: str, mc_samples: int
):
    problem, make_loss, change_targets, match = REFUSED[name]
    case = build_case(problem)
    optimizer = DampedNewton(
        case.model.parameters(),
        damping=1.0,
        criterion=1,
        mc_samples=mc_samples,
        seed=0,
        **VIVIT_STEP,
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    loss_fn = extend(make_loss().double())
    closure = make_closure(
        optimizer, case.model, loss_fn, case.X, change_targets(case.y)
    )
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)

    with pytest.raises(ValueError, match=match):
        optimizer.step(closure)

    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), before)


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
        optimizer.state["groups"][0]["evals"], expected.evals, name="eigenvalues"
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
