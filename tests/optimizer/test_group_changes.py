"""Changes to the param groups that the curvature cannot follow are refused clearly.

A group's basis switched during training (the two bases keep different curvature),
and a layer whose weight and bias are in different groups of the Kronecker basis
(which steps each layer as one block). Either is refused with what to do, and the
parameters and the state stay as they were.
"""

from __future__ import annotations

import pytest
import torch

from dampednewton import DampedNewton, GramBasis, KroneckerBasis
from tests.cases import PROBLEMS
from tests.utils import assert_same_state, build_case, make_closure, snapshot

MLP_CE = PROBLEMS[0]


@pytest.mark.parametrize(
    ("first", "then", "match"),
    [
        (KroneckerBasis(), GramBasis(), "stepped with KroneckerBasis"),
        (GramBasis(), KroneckerBasis(), "stepped with GramBasis"),
    ],
    ids=["kronecker-to-gram", "gram-to-kronecker"],
)
def test_a_group_basis_switched_during_training_is_refused(first, then, match):
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), basis=first, seed=0)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(3):
        optimizer.step(closure)
    optimizer.param_groups[0]["basis"] = then
    values = [p.detach().clone() for p in case.model.parameters()]
    state = snapshot(optimizer)
    with pytest.raises(ValueError, match=match + ".*Create a new DampedNewton"):
        optimizer.step(closure)
    assert all(
        torch.equal(p, v) for p, v in zip(case.model.parameters(), values, strict=True)
    )
    assert_same_state(snapshot(optimizer), state)


def test_a_layer_split_between_kronecker_groups_is_refused():
    case = build_case(MLP_CE)
    first, _, last = case.model
    optimizer = DampedNewton(
        [
            {"params": [first.weight, last.weight]},
            {"params": [first.bias, last.bias], "weight_decay": 0.0},
        ],
        seed=0,
    )
    values = [p.detach().clone() for p in case.model.parameters()]
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    with pytest.raises(ValueError, match="weight and bias are in different parameter"):
        optimizer.step(closure)
    assert all(
        torch.equal(p, v) for p, v in zip(case.model.parameters(), values, strict=True)
    )


def test_gram_groups_may_split_layers():
    case = build_case(MLP_CE)
    first, _, last = case.model
    optimizer = DampedNewton(
        [{"params": [first.weight, last.weight]}, {"params": [first.bias, last.bias]}],
        basis=GramBasis(),
        seed=0,
    )
    values = [p.detach().clone() for p in case.model.parameters()]
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    for param, value in zip(case.model.parameters(), values, strict=True):
        assert not torch.equal(param, value)
