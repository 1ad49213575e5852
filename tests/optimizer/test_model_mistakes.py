"""Usual mistakes: a model class, an unextended module, inference mode, slicing.

A model class whose ``forward`` calls its layers is the most common way to write a
model, and BackPACK treats it as one operation it has no rule for: the error says
so and names the two ways out, one of which (BackPACK's converter) is tested to
train here, against real BackPACK.
"""

from __future__ import annotations

import copy

import pytest
import torch
from backpack import extend
from torch import nn

from dampednewton import DampedNewton, GramBasis
from tests.utils import assert_parameters_equal, make_closure

CONVERTER = r"extend\(model, use_converter=True\)"


class Classifier(nn.Module):
    """A model class: the layers in a ``Sequential``, one residual block."""

    def __init__(self, residual: bool = False, activation: type = nn.ReLU) -> None:
        super().__init__()
        self.residual = residual
        self.inner = nn.Linear(6, 6)
        self.activation = activation()
        self.head = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.activation(self.inner(inputs))
        if self.residual:
            hidden = inputs + hidden
        return self.head(hidden)


def _data():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(16, 6, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 3, (16,), generator=generator)
    return inputs, targets


def _model(**options) -> nn.Module:
    torch.manual_seed(0)
    return Classifier(**options).double()


def _refused(
    model: nn.Module, error: type[Exception], match: str, basis: str = "kronecker"
) -> None:
    inputs, targets = _data()
    loss_fn = extend(nn.CrossEntropyLoss())
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(model.parameters(), seed=0, **options)
    values = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        optimizer.step(make_closure(optimizer, model, loss_fn, inputs, targets))
    assert_parameters_equal(list(model.parameters()), values)


def test_a_model_class_is_refused_with_the_ways_out():
    _refused(
        extend(_model()),
        NotImplementedError,
        r"cannot handle Classifier, a custom module with submodules.*"
        r"nn\.Sequential of supported modules.*" + CONVERTER,
    )


def test_the_unsupported_submodules_of_a_model_class_are_named():
    _refused(
        extend(_model(activation=nn.Softsign)),
        NotImplementedError,
        r"Of its submodules, BackPACK does not support Softsign either",
    )


def test_a_module_left_out_of_extend_is_named_as_a_cause():
    torch.manual_seed(0)
    model = nn.Sequential(
        extend(nn.Linear(6, 8)), nn.ReLU(), extend(nn.Linear(8, 3))
    ).double()
    _refused(
        model,
        RuntimeError,
        r"No curvature information reached Linear.*a module between it and this one"
        r" \(an activation",
    )


class SlicedOutputs(nn.Module):
    """A head of 5 outputs whose first 3 go to the loss (a tensor operation)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.model = extend(nn.Sequential(*layers))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)[:, :3]


@pytest.mark.parametrize(
    "layers",
    [
        (nn.Linear(6, 5),),
        (nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)),
        (nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Sigmoid()),
    ],
    ids=["one-layer", "mlp", "mlp-sigmoid"],
)
@pytest.mark.parametrize("basis", ["kronecker", "gram"])
def test_outputs_sliced_before_the_loss_are_named_with_the_fix(layers, basis):
    torch.manual_seed(0)
    _refused(
        SlicedOutputs(*layers).double(),
        RuntimeError,
        r"took a part \(\d+, 3\) of the model's output \(\d+, 5\) \(slicing",
        basis=basis,
    )


def _train(model: nn.Module, steps: int) -> list[float]:
    inputs, targets = _data()
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(model.parameters(), seed=0)
    closure = make_closure(optimizer, model, loss_fn, inputs, targets)
    return [optimizer.step(closure).item() for _ in range(steps)]


def test_a_converted_model_class_trains_as_its_sequential_twin():
    """The converter keeps the operations: the same steps as the ``nn.Sequential``."""
    model = _model()
    twin = extend(
        nn.Sequential(copy.deepcopy(model.inner), nn.ReLU(), *copy.deepcopy(model.head))
    )
    converted = extend(model, use_converter=True)

    losses, twin_losses = _train(converted, 20), _train(twin, 20)

    torch.testing.assert_close(losses, twin_losses, rtol=1e-10, atol=0.0)
    assert losses[-1] < losses[0]


def test_a_converted_residual_model_class_trains():
    """No ``nn.Sequential`` twin; the loss falls (90× in 20 steps on this problem)."""
    losses = _train(extend(_model(residual=True), use_converter=True), 21)
    assert losses[-1] < losses[0] / 4, losses


def test_a_step_in_inference_mode_says_so():
    inputs, targets = _data()
    model = extend(nn.Sequential(nn.Linear(6, 3)).double())
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(model.parameters(), seed=0)
    closure = make_closure(optimizer, model, loss_fn, inputs, targets)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        optimizer.step(closure)
    optimizer.step(closure)  # outside of it, the same closure steps


class _FlattenedByView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.activation = nn.Conv2d(1, 2, 3, padding=1), nn.Tanh()
        self.head = nn.Linear(12, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.activation(self.conv(inputs))
        return self.head(hidden.view(hidden.size(0), -1))


def test_a_reshape_by_view_is_refused_with_the_flatten_to_use():
    torch.manual_seed(0)
    model = extend(_FlattenedByView().double(), use_converter=True)
    inputs, targets = _data()
    inputs = inputs.reshape(16, 1, 3, 2)
    optimizer = DampedNewton(model.parameters(), seed=0)
    loss_fn = extend(nn.CrossEntropyLoss())
    values = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=r"reshape, transpose or permute after Tanh.*nn\.Flatten\(\)"
    ):
        optimizer.step(make_closure(optimizer, model, loss_fn, inputs, targets))
    assert_parameters_equal(list(model.parameters()), values)


def test_a_negative_log_likelihood_loss_is_refused_with_the_loss_to_use():
    inputs, targets = _data()
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 3), nn.LogSoftmax(dim=1)).double())
    optimizer = DampedNewton(model.parameters(), seed=0)
    closure = make_closure(optimizer, model, extend(nn.NLLLoss()), inputs, targets)
    with pytest.raises(NotImplementedError, match="CrossEntropyLoss on the logits"):
        optimizer.step(closure)


def test_a_model_on_the_meta_device_is_refused_with_what_to_do():
    with torch.device("meta"):
        model = extend(nn.Sequential(nn.Linear(6, 3)))
    optimizer = DampedNewton(model.parameters())
    inputs = torch.empty(4, 6, device="meta")
    targets = torch.zeros(4, dtype=torch.long, device="meta")
    closure = make_closure(
        optimizer, model, extend(nn.CrossEntropyLoss()), inputs, targets
    )
    with pytest.raises(RuntimeError, match=r"meta device.*model\.to_empty"):
        optimizer.step(closure)
