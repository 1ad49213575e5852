"""The test problems' models: tiny float64 networks from a local generator.

Each builder creates its layers on the meta device (torch's default initialization
never runs) and materializes them with :func:`initialize`.
"""

from __future__ import annotations

import torch
from torch import nn

NUM_CLASSES = 3


def initialize(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Materialize a meta-device module in float64 with parameters from a generator.

    Each layer's weight and bias are drawn from N(0, 1/fan_in), fan_in being the
    number of weight entries per output unit.

    Args:
        module: Module whose parameters live on the meta device.
        generator: Source of the parameter values.

    Returns:
        The module, on the CPU in float64, with initialized parameters.
    """
    module = module.to_empty(device="cpu").to(torch.float64)
    with torch.no_grad():
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            if not isinstance(weight, nn.Parameter):
                continue
            scale = weight[0].numel() ** -0.5
            for param in (weight, getattr(layer, "bias", None)):
                if isinstance(param, nn.Parameter):
                    param.copy_(
                        scale
                        * torch.randn(
                            param.shape, generator=generator, dtype=torch.float64
                        )
                    )
    return module


def mlp_relu(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, NUM_CLASSES))
    return initialize(model, generator)


def mlp_sigmoid(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, NUM_CLASSES))
    return initialize(model, generator)


def mlp_tanh_scalar(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    return initialize(model, generator)


def mlp_repeated(generator: torch.Generator) -> nn.Module:
    # Two hidden Linear(4, 4) of one shape: the Kronecker step batches them.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(5, 4),
            nn.Tanh(),
            nn.Linear(4, 4),
            nn.Tanh(),
            nn.Linear(4, 4),
            nn.Tanh(),
            nn.Linear(4, NUM_CLASSES),
        )
    return initialize(model, generator)


def mlp_smooth(generator: torch.Generator) -> nn.Module:
    # Activations the package adds to BackPACK's (GELU, SiLU, Mish); the two hidden
    # Linear(4, 4) share a shape.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(5, 4),
            nn.GELU(),
            nn.Linear(4, 4),
            nn.SiLU(),
            nn.Linear(4, 4),
            nn.Mish(),
            nn.Linear(4, NUM_CLASSES),
        )
    return initialize(model, generator)


def mlp_smooth_branches(generator: torch.Generator) -> nn.Module:
    # The other added activations, with curvature of their own: GELU's tanh
    # approximation, a Softplus whose linear branch some inputs reach (βx > 1),
    # Hardswish.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(5, 4),
            nn.GELU(approximate="tanh"),
            nn.Linear(4, 4),
            nn.Softplus(beta=2.0, threshold=1.0),
            nn.Linear(4, 4),
            nn.Hardswish(),
            nn.Linear(4, NUM_CLASSES),
        )
    return initialize(model, generator)


def cnn(generator: torch.Generator) -> nn.Module:
    # [N, 1, 6, 6] -> conv [N, 2, 4, 4] -> pool [N, 2, 2, 2] -> flatten [N, 8]
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(1, 2, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8, NUM_CLASSES),
        )
    return initialize(model, generator)


def cnn_global_pool(generator: torch.Generator) -> nn.Module:
    # [N, 1, 6, 6] -> conv [N, 3, 4, 4] -> global average pool [N, 3, 1, 1] ->
    # flatten [N, 3] -> Linear: the pooling BackPACK's square roots lack.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(1, 3, 3),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(3, NUM_CLASSES),
        )
    return initialize(model, generator)


def cnn_no_pool(generator: torch.Generator) -> nn.Module:
    # [N, 1, 5, 5] -> conv [N, 2, 3, 3] -> flatten [N, 18]
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(1, 2, kernel_size=3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(18, NUM_CLASSES),
        )
    return initialize(model, generator)


def sequence_mlp(generator: torch.Generator) -> nn.Module:
    # [N, 2, 12] -> shared Linear [N, 2, 6] -> flatten [N, 12]: few positions, so the
    # first weight takes the structured shared-weight path.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(12, 6), nn.Tanh(), nn.Flatten(), nn.Linear(12, NUM_CLASSES)
        )
    return initialize(model, generator)


def cnn_few_positions(generator: torch.Generator) -> nn.Module:
    # [N, 6, 4, 4] -> conv [N, 6, 2, 2] -> flatten [N, 24]: 4 output positions and 54
    # inputs per position, so the exact GGN's conv weight is contracted structurally.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(6, 6, kernel_size=3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(24, NUM_CLASSES),
        )
    return initialize(model, generator)


def cnn1d(generator: torch.Generator) -> nn.Module:
    # [N, 2, 9] -> strided, padded conv [N, 3, 5] -> flatten [N, 15] -> Linear.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv1d(2, 3, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(15, NUM_CLASSES),
        )
    return initialize(model, generator)


def linear_2_to_3(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, NUM_CLASSES))
    return initialize(model, generator)


def linear_5_to_3(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, NUM_CLASSES))
    return initialize(model, generator)


def wide_then_narrow_mlp(generator: torch.Generator) -> nn.Module:
    """A wide first layer, then narrow ones (tanh): a packed group takes three packs."""
    with torch.device("meta"):
        narrow = [module for _ in range(3) for module in (nn.Linear(3, 3), nn.Tanh())]
        model = nn.Sequential(
            nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 3), nn.Tanh(), *narrow
        )
        model.append(nn.Linear(3, 2))
    return initialize(model, generator)
