"""Layer configurations whose BackPACK derivatives are wrong or crash are refused.

Also one weight in two modules (weight tying): BackPACK computes each module's
quantities apart, so the curvature would be that of one use.

BackPACK's convolution derivatives take the padding as numbers of zeros: for
``padding="same"`` or ``padding_mode="circular"`` they give a silently wrong GGN (2–9 %
off in the eigenvalues, a step 50 % off), also for the layers before such a
convolution. Each case here must be refused by the optimizer (both bases, parameters
unchanged) and by the computations, with the way out; the fixes the messages name are
checked to compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from backpack import backpack, extend
from torch import nn

from dampednewton import DampedNewton, EigvalshComputation, GramBasis
from tests.utils import assert_parameters_equal, make_closure


@dataclass(frozen=True)
class Mistake:
    """A model (float64, CrossEntropyLoss on 3 classes) and what its refusal says."""

    id: str
    layers: tuple[nn.Module, ...]
    input_shape: tuple[int, ...]
    error: type[Exception]
    match: str
    frozen: tuple[int, ...] = field(default=())  # layers whose parameters are frozen
    tied: tuple[int, ...] = field(default=())  # layers that share the first's weight
    dtype: torch.dtype = torch.float64


def _conv(**options) -> tuple[nn.Module, ...]:
    return (nn.Conv2d(2, 2, 3, **options), nn.Tanh(), nn.Flatten(), nn.Linear(32, 3))


MISTAKES = [
    Mistake(
        "conv-padding-same",
        _conv(padding="same"),
        (2, 4, 4),
        NotImplementedError,
        r"Conv2d\(padding='same'\) is not supported.*padding=\(1, 1\), the same",
    ),
    Mistake(
        "conv1d-padding-same-even-kernel",
        (nn.Conv1d(2, 2, 4, padding="same"), nn.Flatten(), nn.Linear(12, 3)),
        (2, 6),
        NotImplementedError,
        r"Conv1d\(padding='same'\) is not supported.*an odd kernel size",
    ),
    *(
        Mistake(
            f"conv-padding-mode-{mode}",
            _conv(padding=1, padding_mode=mode),
            (2, 4, 4),
            NotImplementedError,
            rf"Conv2d\(padding_mode='{mode}'\) is not supported.*padding_mode='zeros'",
        )
        for mode in ("circular", "reflect", "replicate")
    ),
    Mistake(
        "frozen-circular-conv-after-a-trained-layer",
        (
            nn.Conv2d(2, 2, 3, padding=1),
            nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"),
            nn.Flatten(),
            nn.Linear(32, 3),
        ),
        (2, 4, 4),
        NotImplementedError,
        r"padding_mode='circular'.*of every layer before it would be wrong",
        frozen=(1,),
    ),
    Mistake(
        "conv-transpose-output-padding",
        (
            nn.ConvTranspose2d(2, 1, 3, stride=2, padding=1, output_padding=1),
            nn.Flatten(),
            nn.Linear(64, 3),
        ),
        (2, 4, 4),
        NotImplementedError,
        r"ConvTranspose2d\(output_padding=\(1, 1\)\) is not supported",
    ),
    *(
        Mistake(
            f"tied-weights-{'with' if bias else 'without'}-biases",
            (
                nn.Linear(4, 4, bias=bias),
                nn.Tanh(),
                nn.Linear(4, 4, bias=bias),
                nn.Tanh(),
                nn.Linear(4, 3),
            ),
            (4,),
            NotImplementedError,
            r"shape \(4, 4\) is used by two modules \(weight tying",
            tied=(0, 2),
        )
        for bias in (True, False)
    ),
    Mistake(
        "embedding-in-float64",
        (nn.Embedding(5, 4), nn.Flatten(), nn.Linear(8, 3)),
        (2,),
        RuntimeError,
        r"derivatives of Embedding fail in torch.float64.*hold the model in float32",
    ),
    Mistake(
        "embedding-in-bfloat16",
        (nn.Embedding(5, 4), nn.Flatten(), nn.Linear(8, 3)),
        (2,),
        RuntimeError,
        r"derivatives of Embedding fail in torch.bfloat16.*hold the model in float32",
        dtype=torch.bfloat16,
    ),
    Mistake(
        "avgpool-in-bfloat16",
        (nn.Conv2d(1, 2, 3), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(8, 3)),
        (1, 6, 6),
        RuntimeError,
        r"derivatives of AvgPool2d fail in torch.bfloat16.*hold the model in float32",
        dtype=torch.bfloat16,
    ),
]


def _build(mistake: Mistake) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = extend(nn.Sequential(*mistake.layers).to(mistake.dtype))
    for index in mistake.frozen:
        model[index].requires_grad_(False)
    for index in mistake.tied[1:]:
        model[index].weight = model[mistake.tied[0]].weight
    generator = torch.Generator().manual_seed(0)
    if isinstance(mistake.layers[0], nn.Embedding):
        inputs = torch.randint(0, 5, (6, *mistake.input_shape), generator=generator)
    else:
        inputs = torch.randn(6, *mistake.input_shape, generator=generator)
        inputs = inputs.to(mistake.dtype)
    targets = torch.randint(0, 3, (6,), generator=generator)
    return model, inputs, targets


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda mistake: mistake.id)
def test_the_optimizer_refuses_the_configuration(mistake, basis):
    model, inputs, targets = _build(mistake)
    params = [p for p in model.parameters() if p.requires_grad]
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(params, seed=0, **options)
    values = [p.detach().clone() for p in params]
    loss_fn = extend(nn.CrossEntropyLoss())
    with pytest.raises(mistake.error, match=mistake.match):
        optimizer.step(make_closure(optimizer, model, loss_fn, inputs, targets))
    assert_parameters_equal(params, values)


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda mistake: mistake.id)
def test_the_computations_refuse_the_configuration(mistake):
    model, inputs, targets = _build(mistake)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    computation = EigvalshComputation()
    loss_fn = extend(nn.CrossEntropyLoss())
    with (
        pytest.raises(mistake.error, match=mistake.match),
        backpack(
            *computation.get_extensions(),
            extension_hook=computation.get_extension_hook(groups),
        ),
    ):
        loss_fn(model(inputs), targets).backward()


def test_the_named_numeric_padding_is_the_same_function():
    """``padding=(1, 1)``, as the refusal of ``padding='same'`` says, is equal."""
    torch.manual_seed(0)
    same = nn.Conv2d(2, 2, 3, padding="same").double()
    numeric = nn.Conv2d(2, 2, 3, padding=(1, 1)).double()
    numeric.load_state_dict(same.state_dict())
    inputs = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    assert torch.equal(same(inputs), numeric(inputs))


def test_the_named_transposed_convolution_doubles_the_size_as_well():
    inputs = torch.randn(1, 2, 4, 4)
    with_output_padding = nn.ConvTranspose2d(2, 1, 3, 2, padding=1, output_padding=1)
    named = nn.ConvTranspose2d(2, 1, 4, 2, padding=1)
    assert with_output_padding(inputs).shape == named(inputs).shape == (1, 1, 8, 8)
