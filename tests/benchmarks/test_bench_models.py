"""Model builders: shapes, seeded initialization, no use of the global RNG."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from backpack import extend
from torch import nn

from benchmarks.problems import models
from dampednewton import DampedNewton

MODELS: list[
    tuple[str, Callable[[torch.Generator], nn.Module], tuple[int, ...], int]
] = [
    ("mlp", lambda g: models.mlp(64, [32, 16], 10, "tanh", generator=g), (64,), 10),
    ("logreg", lambda g: models.logistic_regression(64, 10, generator=g), (64,), 10),
    ("mnist1d_cnn", lambda g: models.mnist1d_cnn(generator=g), (1, 40), 10),
    ("conv_2c2d", lambda g: models.conv_2c2d(generator=g), (1, 28, 28), 10),
    ("cifar10_3c3d", lambda g: models.cifar10_3c3d(generator=g), (3, 32, 32), 10),
]


@pytest.fixture(params=MODELS, ids=[m[0] for m in MODELS])
def model_case(request):
    """(name, builder, input shape, number of outputs)."""
    return request.param


def test_output_shape(model_case):
    _, build, input_shape, outputs = model_case
    model = build(torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(torch.zeros(2, *input_shape))
    assert out.shape == (2, outputs)


def test_seeded_and_global_rng_untouched(model_case):
    name, build, _, _ = model_case
    state = torch.get_rng_state()
    first = build(torch.Generator().manual_seed(1))
    again = build(torch.Generator().manual_seed(1))
    other = build(torch.Generator().manual_seed(2))
    assert torch.equal(torch.get_rng_state(), state), f"{name} used the global RNG"
    for a, b, c in zip(
        first.parameters(), again.parameters(), other.parameters(), strict=True
    ):
        assert torch.equal(a, b), f"{name}: same seed, different parameters"
        assert not torch.equal(a, c), f"{name}: different seeds, same parameters"


def test_default_init_bounds(model_case):
    name, build, _, _ = model_case
    model = build(torch.Generator().manual_seed(0))
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d):
            bound = 1 / math.sqrt(module.weight[0].numel())
            for p in (module.weight, module.bias):
                assert p.abs().max() <= bound, f"{name}: {p.abs().max()} > {bound}"
                assert p.abs().max() > 0.5 * bound, f"{name}: values not spread out"


def test_unknown_activation_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown activation 'swish'"):
        models.mlp(4, [3], 2, "swish", generator=torch.Generator())


@pytest.mark.parametrize("name", ["relu", "tanh", "sigmoid", "gelu", "silu"])
def test_every_activation_builds_an_mlp_the_optimizer_steps(name):
    generator = torch.Generator().manual_seed(0)
    model = extend(models.mlp(4, [3], 2, name, generator=generator))
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(model.parameters())
    X, y = torch.randn(8, 4, generator=generator), torch.arange(8) % 2
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        return loss

    assert torch.isfinite(optimizer.step(closure))
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.isfinite(new).all() and not torch.equal(old, new)


def test_3c3d_has_deepobs_parameter_count():
    model = models.cifar10_3c3d(generator=torch.Generator().manual_seed(0))
    # DeepOBS's cifar10_3c3d: 895,210 parameters.
    assert sum(p.numel() for p in model.parameters()) == 895_210
