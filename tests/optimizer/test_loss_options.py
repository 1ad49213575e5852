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


def test_other_refusals_of_a_supported_module_keep_backpacks_reason():
    generator = torch.Generator().manual_seed(0)
    model = extend(
        nn.Sequential(nn.Embedding(5, 3, padding_idx=0), nn.Flatten(), nn.Linear(6, 3))
    )
    loss_fn = extend(nn.CrossEntropyLoss())
    tokens = torch.randint(0, 5, (4, 2), generator=generator)
    optimizer = DampedNewton(model.parameters(), basis=GramBasis())
    closure = make_closure(
        optimizer, model, loss_fn, tokens, torch.tensor([0, 1, 2, 0])
    )

    with pytest.raises(
        NotImplementedError,
        match=r"supports Embedding, but not this configuration of it: "
        r"Only padding_idx=None",
    ):
        optimizer.step(closure)


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
@pytest.mark.parametrize("mc_samples", [0, 1], ids=["exact", "mc1"])
def test_binary_cross_entropy_takes_soft_targets_and_several_outputs(basis, mc_samples):
    """BackPACK's derivatives refuse both; its Hessian depends on neither.

    Nor does it couple the outputs (``mlp-bce-multilabel`` checks the GGN against
    autograd).
    """
    generator = torch.Generator().manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)))
    loss_fn = extend(nn.BCEWithLogitsLoss())
    inputs = torch.randn(32, 5, generator=generator)
    targets = (inputs[:, :3] > 0).float() * 0.8 + 0.1  # smoothed labels 0.1 / 0.9
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(model.parameters(), mc_samples=mc_samples, **options)
    closure = make_closure(optimizer, model, loss_fn, inputs, targets)
    first = optimizer.step(closure)
    for _ in range(10):
        last = optimizer.step(closure)
    assert last < first


@pytest.mark.parametrize(
    ("outputs", "targets"),
    [((32,), (32,)), ((32, 2, 2), (32, 2, 2))],
    ids=["squeezed", "3-d"],
)
def test_binary_cross_entropy_of_other_shapes_is_refused_with_the_fix(outputs, targets):
    inputs = torch.randn(*outputs)
    model = extend(nn.Identity())
    weight = nn.Parameter(torch.ones(()))
    loss_fn = extend(nn.BCEWithLogitsLoss())
    optimizer = DampedNewton([weight])
    labels = torch.zeros(targets)

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model(inputs * weight), labels)
        loss.backward()
        return loss

    with pytest.raises(ValueError, match=r"shape \(N, C\).*targets\.float\(\)"):
        optimizer.step(closure)


@pytest.mark.parametrize(
    "loss_fn", [nn.MSELoss(), nn.BCEWithLogitsLoss()], ids=["mse", "bce"]
)
def test_outputs_of_several_dimensions_are_refused_with_the_flatten_fix(loss_fn):
    """An image-to-image model (an autoencoder, a mask): the advice is nn.Flatten()."""
    inputs = torch.randn(4, 1, 5, 5, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 1, 1))
    model, loss_fn = extend(conv), extend(loss_fn)
    targets = (inputs > 0).to(inputs.dtype)
    optimizer = DampedNewton(model.parameters())
    closure = make_closure(optimizer, model, loss_fn, inputs, targets)
    with pytest.raises(ValueError, match=r"end the model with nn\.Flatten\(\)"):
        optimizer.step(closure)
    # The advice works.
    flattened = extend(nn.Sequential(*conv, nn.Flatten()))
    optimizer = DampedNewton(flattened.parameters())
    closure = make_closure(optimizer, flattened, loss_fn, inputs, targets.flatten(1))
    first = optimizer.step(closure)
    for _ in range(5):
        last = optimizer.step(closure)
    assert last < first


def test_the_reduction_refusal_names_the_loss_without_its_repr():
    """The message names the class: torch's repr omits the reduction."""
    case = build_case(MLP_CE)
    loss_fn = extend(nn.CrossEntropyLoss(reduction="sum"))
    optimizer = DampedNewton(case.model.parameters())
    closure = make_closure(optimizer, case.model, loss_fn, case.X, case.y)
    with pytest.raises(ValueError, match=r"^CrossEntropyLoss uses reduction='sum'"):
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


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
def test_a_closure_that_back_propagates_with_create_graph_steps(basis):
    """E.g. for a gradient penalty: the Monte-Carlo draws record no graph."""
    case = build_case(PROBLEMS[0])
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(case.model.parameters(), seed=0, **options)
    twin = build_case(PROBLEMS[0])
    plain = DampedNewton(twin.model.parameters(), seed=0, **options)

    def closure():
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(case.X), case.y)
        loss.backward(create_graph=True)
        return loss

    for _ in range(3):
        optimizer.step(closure)
        plain.step(make_closure(plain, twin.model, twin.loss_fn, twin.X, twin.y))
    assert_parameters_equal(
        list(case.model.parameters()), list(twin.model.parameters())
    )


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
@pytest.mark.parametrize("step", [0, 2], ids=["refresh", "between"])
def test_binary_targets_outside_zero_one_are_refused(basis, step):
    """Labels −1/+1: the loss is unbounded below there (BackPACK refused them too)."""
    case = build_case(MLP_BCE)
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(case.model.parameters(), seed=0, **options)
    run_steps = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(step):
        optimizer.step(run_steps)
    values = [p.detach().clone() for p in case.model.parameters()]
    signs = 2 * case.y - 1
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, signs)
    with pytest.raises(ValueError, match=r"targets of BCEWithLogitsLoss lie outside"):
        optimizer.step(closure)
    assert_parameters_equal(list(case.model.parameters()), values)
