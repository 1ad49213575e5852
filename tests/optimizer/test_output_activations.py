"""Models whose last layer keeps its output for the backward pass.

Sigmoid, Tanh and ReLU save their output; the Monte-Carlo draws must not touch it
in a way autograd sees (they sanitize non-finite outputs in place, through
``.data``). The default ``mc_samples=1`` steps, and a non-finite output is still
refused without a trace.
"""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from torch import nn

from dampednewton import DampedNewton, GramBasis
from tests.utils import assert_parameters_equal, make_closure

ACTIVATIONS = {"sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "relu": nn.ReLU}
BASES = {"kronecker": {}, "gram": {"basis": GramBasis()}}


def _problem(activation: type[nn.Module]):
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), activation())
    inputs = torch.randn(16, 4, generator=generator)
    targets = torch.rand(16, 3, generator=generator)
    return extend(model), extend(nn.MSELoss()), inputs, targets


@pytest.mark.parametrize("basis", BASES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_a_model_ending_in_an_activation_steps_with_monte_carlo(activation, basis):
    model, loss_fn, inputs, targets = _problem(ACTIVATIONS[activation])
    optimizer = DampedNewton(model.parameters(), seed=0, **BASES[basis])
    closure = make_closure(optimizer, model, loss_fn, inputs, targets)
    first = optimizer.step(closure)
    for _ in range(10):
        last = optimizer.step(closure)
    assert last < first


@pytest.mark.parametrize("basis", BASES)
def test_its_non_finite_output_is_still_refused_without_a_trace(basis):
    model, loss_fn, inputs, targets = _problem(nn.Sigmoid)
    optimizer = DampedNewton(
        model.parameters(), seed=0, nonfinite="skip", **BASES[basis]
    )
    optimizer.step(make_closure(optimizer, model, loss_fn, inputs, targets))
    values = [p.detach().clone() for p in model.parameters()]
    bad = inputs.clone()
    bad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="refused"):
        optimizer.step(make_closure(optimizer, model, loss_fn, bad, targets))
    assert_parameters_equal(list(model.parameters()), values)
    assert optimizer.records["global"]["skipped_steps"] == 1
