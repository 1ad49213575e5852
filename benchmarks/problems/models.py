"""Models of the benchmark problems, built from BackPACK-supported layers.

Every builder takes a ``torch.Generator`` and draws all parameters from it (modules
are created on the meta device, so torch's default initialization never touches the
global RNG). Linear and convolution layers use PyTorch's default distribution,
``U(−1/√fan_in, 1/√fan_in)`` for weights and biases.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch
from torch import nn

ModelT = TypeVar("ModelT", bound=nn.Module)

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
}


def _activation(name: str) -> nn.Module:
    """Instantiate an activation by name, with a clear error for unknown names."""
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown activation {name!r}; choose one of {sorted(_ACTIVATIONS)}."
        ) from None


def _materialize(build: Callable[[], ModelT], generator: torch.Generator) -> ModelT:
    """Build on the meta device, allocate on CPU, draw parameters from ``generator``."""
    with torch.device("meta"):
        model = build()
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d):
                fan_in = module.weight[0].numel()
                bound = 1.0 / math.sqrt(fan_in)
                module.weight.uniform_(-bound, bound, generator=generator)
                if module.bias is not None:
                    module.bias.uniform_(-bound, bound, generator=generator)
    return model


def mlp(
    in_features: int,
    hidden: Sequence[int],
    out_features: int,
    activation: str = "relu",
    *,
    generator: torch.Generator,
) -> nn.Sequential:
    """Fully-connected network ``in → hidden[0] → … → out`` with activations.

    Args:
        in_features: Input size.
        hidden: Widths of the hidden layers (empty: logistic regression).
        out_features: Output size (number of classes).
        activation: ``"relu"``, ``"tanh"`` or ``"sigmoid"``.
        generator: Source of the initial parameters.

    Returns:
        The model.
    """
    widths = [in_features, *hidden, out_features]

    def build() -> nn.Sequential:
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
            if i > 0:
                layers.append(_activation(activation))
            layers.append(nn.Linear(n_in, n_out))
        return nn.Sequential(*layers)

    _activation(activation)
    return _materialize(build, generator)


def logistic_regression(
    in_features: int, out_features: int, *, generator: torch.Generator
) -> nn.Sequential:
    """A single linear layer (multinomial logistic regression with cross-entropy).

    Args:
        in_features: Input size.
        out_features: Number of classes.
        generator: Source of the initial parameters.

    Returns:
        The model.
    """
    return mlp(in_features, [], out_features, generator=generator)


def mnist1d_cnn(
    channels: int = 25, out_features: int = 10, *, generator: torch.Generator
) -> nn.Sequential:
    """Three strided 1d convolutions and a linear read-out, for ``[N, 1, 40]`` inputs.

    The architecture of MNIST-1D's reference CNN: kernel sizes 5, 3, 3, stride 2,
    padding 1, ReLU; the sequence length shrinks 40 → 19 → 10 → 5.

    Args:
        channels: Channels of every convolution.
        out_features: Number of classes.
        generator: Source of the initial parameters.

    Returns:
        The model.
    """

    def build() -> nn.Sequential:
        return nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(channels * 5, out_features),
        )

    return _materialize(build, generator)


def conv_2c2d(out_features: int = 10, *, generator: torch.Generator) -> nn.Sequential:
    """DeepOBS's ``2c2d`` for ``[N, 1, 28, 28]`` inputs.

    Two 5×5 convolutions (32 and 64 channels, "same" padding, ReLU, 2×2 max-pooling)
    followed by fully-connected layers 3136 → 1024 → ``out_features``.

    Args:
        out_features: Number of classes.
        generator: Source of the initial parameters.

    Returns:
        The model (3.3 M parameters).
    """

    def build() -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(7 * 7 * 64, 1024),
            nn.ReLU(),
            nn.Linear(1024, out_features),
        )

    return _materialize(build, generator)


def cifar10_3c3d(
    out_features: int = 10, *, generator: torch.Generator
) -> nn.Sequential:
    """DeepOBS's ``cifar10_3c3d`` for ``[N, 3, 32, 32]`` inputs.

    Convolutions 5×5 (64 channels, no padding), 3×3 (96, no padding) and 3×3 (128,
    "same"), each followed by ReLU and 3×3 max-pooling of stride 2 with TensorFlow's
    "same" padding (one zero row and column after the ReLU: the same maximum), then
    fully-connected layers 1152 → 512 → 256 → ``out_features``. The model of ViViT's
    memory benchmark (its critical batch sizes).

    Args:
        out_features: Number of classes.
        generator: Source of the initial parameters.

    Returns:
        The model (0.9 M parameters).
    """

    def build() -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(3, 64, 5),
            nn.ReLU(),
            nn.ZeroPad2d((0, 1, 0, 1)),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(64, 96, 3),
            nn.ReLU(),
            nn.ZeroPad2d((0, 1, 0, 1)),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(96, 128, 3, padding=1),
            nn.ReLU(),
            nn.ZeroPad2d((0, 1, 0, 1)),
            nn.MaxPool2d(3, stride=2),
            nn.Flatten(),
            nn.Linear(3 * 3 * 128, 512),
            nn.ReLU(),
            nn.Linear(512, 256),
            nn.ReLU(),
            nn.Linear(256, out_features),
        )

    return _materialize(build, generator)


def quadratic_model(
    readout: np.ndarray, init_value: float = 1.0, *, generator: torch.Generator
) -> nn.Sequential:
    """The quadratic's model ``1 ↦ S θ`` (see :mod:`benchmarks.problems.quadratics`).

    ``θ`` is the weight of a bias-free ``Linear(1, D)``, set to ``init_value``
    everywhere; ``S`` is a frozen bias-free ``Linear(D, D)`` (``requires_grad`` off,
    so optimizers must receive only the trainable parameters).

    Args:
        readout: The ``D × D`` read-out ``S``.
        init_value: Initial value of every coordinate of ``θ``.
        generator: Unused (the initialization is deterministic); accepted so that all
            model builders share one signature.

    Returns:
        The model.
    """
    del generator
    matrix = torch.as_tensor(np.asarray(readout), dtype=torch.float64)
    dim = matrix.shape[0]
    with torch.device("meta"):
        theta = nn.Linear(1, dim, bias=False)
        readout_layer = nn.Linear(dim, dim, bias=False)
        model = nn.Sequential(theta, readout_layer)
    model = model.to_empty(device="cpu").double()
    with torch.no_grad():
        theta.weight.fill_(init_value)
        readout_layer.weight.copy_(matrix)
    readout_layer.weight.requires_grad_(False)
    return model
