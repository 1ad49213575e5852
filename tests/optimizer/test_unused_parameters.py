"""Parameters that a step's forward pass does not use are not moved, as in torch.optim.

Such a parameter has no gradient (``.grad is None``). With the Kronecker basis its
layer keeps its curvature at a refresh and steps along it again once used; with the
Gram basis a group that the step leaves unused takes no step, and a group used in
part is refused at a refresh (its block's curvature is incomplete).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from backpack import extend
from torch import Tensor

from dampednewton import DampedNewton, GramBasis
from dampednewton.diagnostics import GSNR, DiagnosticsMonitor
from tests.cases import PROBLEMS
from tests.utils import Case, build_case

MLP_CE = PROBLEMS[0]
UNUSED_STEPS = (2, 3)  # between refreshes, then the refresh at step 3


def _closure(
    optimizer: DampedNewton, case: Case, unused: bool, set_to_none: bool = True
) -> Callable[[], Tensor]:
    """The loss with the first layer's output detached (its parameters unused)."""
    first, *rest = case.model

    def closure() -> Tensor:
        optimizer.zero_grad(set_to_none=set_to_none)
        hidden = first(case.X)
        if unused:
            hidden = hidden.detach()
        loss = case.loss_fn(torch.nn.Sequential(*rest)(hidden), case.y)
        loss.backward()
        return loss

    return closure


def _state_of(optimizer: DampedNewton, params) -> list[dict]:
    return [
        {
            k: v.clone() if isinstance(v, Tensor) else v
            for k, v in optimizer.state[p].items()
        }
        for p in params
    ]


def test_an_unused_layer_keeps_its_values_and_curvature_and_steps_again():
    case = build_case(MLP_CE)
    twin = build_case(MLP_CE)  # the first layer frozen instead of unused
    first = list(case.model[0].parameters())
    optimizer = DampedNewton(case.model.parameters(), seed=0)
    frozen = DampedNewton(twin.model.parameters(), seed=0)
    for step in range(5):
        unused = step in UNUSED_STEPS
        values, state = [p.clone() for p in first], _state_of(optimizer, first)
        twin.model[0].requires_grad_(not unused)
        optimizer.step(_closure(optimizer, case, unused))
        frozen.step(_closure(frozen, twin, False))
        if unused:
            assert all(torch.equal(p, v) for p, v in zip(first, values, strict=True))
            for saved, param in zip(state, first, strict=True):
                assert saved.keys() == optimizer.state[param].keys()
                for key, value in saved.items():
                    assert torch.equal(optimizer.state[param][key], value), key
        if step <= UNUSED_STEPS[-1]:  # the rest of the model: as with a frozen layer
            for mine, other in zip(
                case.model.parameters(), twin.model.parameters(), strict=True
            ):
                assert torch.equal(mine, other)
    # Used again between refreshes (step 4), the layer steps along its kept basis;
    # the frozen twin's layer joins at the next refresh only.
    assert not torch.equal(first[0], twin.model[0].weight)


def test_zeroed_gradients_of_an_unused_layer_keep_its_curvature_at_a_refresh():
    """``zero_grad(set_to_none=False)``: zeros where a step does not reach.

    The layer is unused all the same (its factors kept through the refresh at step
    3), not refused as a layer no curvature reached.
    """
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), seed=0)
    weight = case.model[0].weight
    for step in range(5):
        unused = step in UNUSED_STEPS
        if unused:
            factors = {
                key: value.clone()
                for key, value in optimizer.state[weight].items()
                if key.startswith("kronecker_")
            }
        optimizer.step(_closure(optimizer, case, unused, set_to_none=False))
        if unused:
            assert weight.grad is not None and not weight.grad.any()
            for key, value in factors.items():
                assert torch.equal(optimizer.state[weight][key], value), key
    # the first layer's average holds the refreshes of steps 0 and 1, the other's 3
    assert optimizer.records["groups"][0]["kronecker_layer_refreshes"] == (2, 3)


def test_a_gram_group_that_a_step_leaves_unused_takes_no_step():
    case = build_case(MLP_CE)
    groups = [{"params": list(layer.parameters())} for layer in case.model[::2]]
    optimizer = DampedNewton(groups, basis=GramBasis(), seed=0)
    first = groups[0]["params"]
    for step in range(5):
        unused = step in UNUSED_STEPS
        values = [p.clone() for p in first]
        last = [p.clone() for p in groups[-1]["params"]]
        optimizer.step(_closure(optimizer, case, unused))
        moved = [not torch.equal(p, v) for p, v in zip(first, values, strict=True)]
        assert moved == [not unused] * len(first)
        assert not torch.equal(groups[-1]["params"][0], last[0])


def test_a_gram_group_used_in_part_is_refused_at_a_refresh():
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), basis=GramBasis(), seed=0)
    optimizer.step(_closure(optimizer, case, False))
    values = [p.clone() for p in case.model.parameters()]
    with pytest.raises(RuntimeError, match="groups of their own"):
        optimizer.step(_closure(optimizer, case, True))
    assert all(
        torch.equal(p, v) for p, v in zip(case.model.parameters(), values, strict=True)
    )


def test_an_unused_layer_without_bias_keeps_its_basis_and_curvature_record():
    """Bias-free layers too; the monitor's layer curvatures list every layer."""
    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(6, 5, bias=False),
            torch.nn.Tanh(),
            torch.nn.Linear(5, 3, bias=False),
        ).double()
    )
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(16, 6, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 3, (16,), generator=generator)
    case = Case(
        model, extend(torch.nn.CrossEntropyLoss()), model, None, inputs, targets
    )
    monitor = DiagnosticsMonitor([GSNR()], model.named_parameters())
    optimizer = DampedNewton(model.parameters(), seed=0, monitor=monitor)
    first = model[0].weight
    for step in range(5):
        unused = step in UNUSED_STEPS
        value = first.detach().clone()
        optimizer.step(_closure(optimizer, case, unused))
        assert torch.equal(first, value) == unused
        assert len(optimizer.records["groups"][0]["kronecker_layers"]) == 2
        record = monitor.log[-1]
        assert len(record["newton/layer_curvatures/group0"]) == 2


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
@pytest.mark.parametrize("steps_before", [0, 2], ids=["refresh", "between"])
def test_a_closure_without_backward_is_refused_not_skipped(basis, steps_before):
    """No parameter reached at all is a missing ``loss.backward()``, not unused ones."""
    case = build_case(MLP_CE)
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(case.model.parameters(), seed=0, **options)
    for _ in range(steps_before):
        optimizer.step(_closure(optimizer, case, False))

    def forgot_backward() -> Tensor:
        optimizer.zero_grad()
        return case.loss_fn(case.model(case.X), case.y)

    values = [p.clone() for p in case.model.parameters()]
    with pytest.raises(RuntimeError, match=r"no backward pass.*loss\.backward\(\)"):
        optimizer.step(forgot_backward)
    assert all(
        torch.equal(p, v) for p, v in zip(case.model.parameters(), values, strict=True)
    )
    assert optimizer.records["global"]["step"] == steps_before


def test_an_optimizer_whose_parameters_a_step_leaves_all_unused_takes_no_step():
    """The closure back-propagated, into other parameters: as torch.optim, no step."""
    case = build_case(MLP_CE)
    first, _, last = case.model
    optimizer = DampedNewton(first.parameters(), seed=0)

    def other_parameters_only() -> Tensor:
        optimizer.zero_grad()
        loss = case.loss_fn(last(torch.tanh(first(case.X)).detach()), case.y)
        loss.backward()
        return loss

    optimizer.step(_closure(optimizer, case, False))
    values = [p.clone() for p in first.parameters()]
    optimizer.step(other_parameters_only)
    assert all(
        torch.equal(p, v) for p, v in zip(first.parameters(), values, strict=True)
    )


def _returning_none(optimizer: DampedNewton, case: Case, how: str):
    """A closure that returns None: skipping its batch, or after a backward pass."""

    def closure() -> None:
        if how == "zeroed-in-place":
            optimizer.zero_grad(set_to_none=False)
        elif how == "after-backward":
            optimizer.zero_grad()
            case.loss_fn(case.model(case.X), case.y).backward()

    return closure


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
@pytest.mark.parametrize("how", ["untouched", "zeroed-in-place"])
def test_a_closure_returning_none_without_backward_skips_whatever_grad_holds(
    basis, how
):
    """Skipped by the backward passes it ran (none), not by ``.grad`` being None.

    After a step ``.grad`` holds that step's gradients: a closure that returns None
    before ``zero_grad``, or after ``zero_grad(set_to_none=False)``, skips its batch
    as one after ``zero_grad()`` does (Lightning's skipped ``training_step``).
    """
    case = build_case(MLP_CE)
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(case.model.parameters(), seed=0, **options)
    optimizer.step(_closure(optimizer, case, False))
    values = [p.clone() for p in case.model.parameters()]
    assert optimizer.step(_returning_none(optimizer, case, how)) is None
    assert all(
        torch.equal(p, v) for p, v in zip(case.model.parameters(), values, strict=True)
    )
    assert optimizer.records["global"]["step"] == 1
    optimizer.step(_closure(optimizer, case, False))  # training goes on
    assert optimizer.records["global"]["step"] == 2


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
def test_a_closure_returning_none_after_backward_is_a_missing_return(basis):
    case = build_case(MLP_CE)
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(case.model.parameters(), seed=0, **options)
    values = [p.clone() for p in case.model.parameters()]
    with pytest.raises(TypeError, match=r"got None after a backward pass.*return loss"):
        optimizer.step(_returning_none(optimizer, case, "after-backward"))
    assert all(
        torch.equal(p, v) for p, v in zip(case.model.parameters(), values, strict=True)
    )
