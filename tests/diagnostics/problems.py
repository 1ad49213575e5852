"""Tiny problems for the diagnostics tests, and brute-force curvature references.

Parameters and data come from a local generator (modules are created on the meta
device, so the global RNG is never used). Batch sizes are ≥ 6 because the
debiased GSNR needs ``N ≥ 4``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

from tests import reference
from tests.problems import Problem, initialize

NUM_CLASSES = 3


def _mlp(activation: type[nn.Module]):
    def build(generator: torch.Generator) -> nn.Module:
        with torch.device("meta"):
            model = nn.Sequential(
                nn.Linear(5, 4), activation(), nn.Linear(4, NUM_CLASSES)
            )
        return initialize(model, generator)

    return build


def _cnn(generator: torch.Generator) -> nn.Module:
    # [N, 1, 5, 5] -> conv [N, 2, 3, 3] -> flatten [N, 18]
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(1, 2, kernel_size=3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(18, NUM_CLASSES),
        )
    return initialize(model, generator)


def _classification(*shape: int):
    def draw(generator: torch.Generator) -> tuple[Tensor, Tensor]:
        X = torch.randn(shape, generator=generator, dtype=torch.float64)
        return X, torch.randint(0, NUM_CLASSES, shape[:1], generator=generator)

    return draw


def _regression(*shape: int):
    def draw(generator: torch.Generator) -> tuple[Tensor, Tensor]:
        X = torch.randn(shape, generator=generator, dtype=torch.float64)
        y = torch.randn(shape[0], NUM_CLASSES, generator=generator, dtype=torch.float64)
        return X, y

    return draw


PROBLEMS = [
    Problem(
        "mlp-relu-ce", _mlp(nn.ReLU), nn.CrossEntropyLoss, _classification(8, 5), 10
    ),
    Problem("mlp-relu-mse", _mlp(nn.ReLU), nn.MSELoss, _regression(7, 5), 11),
    Problem("cnn-ce", _cnn, nn.CrossEntropyLoss, _classification(6, 1, 5, 5), 12),
    Problem("cnn-mse", _cnn, nn.MSELoss, _regression(6, 1, 5, 5), 13),
    # Sigmoid has curvature of its own, so the Hessian differs from the GGN.
    Problem(
        "mlp-sigmoid-ce",
        _mlp(nn.Sigmoid),
        nn.CrossEntropyLoss,
        _classification(6, 5),
        14,
    ),
]


def hessian_diagonal(
    model: nn.Module, loss_fn: nn.Module, params: list[Tensor], X: Tensor, y: Tensor
) -> Tensor:
    """Diagonal of the mean loss's full Hessian (an autograd loop over its rows).

    Returns:
        Vector over the concatenated ``params``.
    """
    names = [name for p in params for name, q in model.named_parameters() if q is p]

    def loss_of(theta: Tensor) -> Tensor:
        overrides = dict(zip(names, reference.unflatten(theta, params), strict=True))
        return loss_fn(functional_call(model, overrides, (X,)), y)

    theta = reference.flatten([p.detach() for p in params])
    return torch.diagonal(torch.autograd.functional.hessian(loss_of, theta)).detach()


def ggn_diagonal(
    model: nn.Module, loss_fn: nn.Module, params: list[Tensor], X: Tensor, y: Tensor
) -> Tensor:
    """Diagonal of the GGN ``(1/N) Σ_n J_nᵀ H_n J_n`` from explicit Jacobians.

    Returns:
        Vector over the concatenated ``params``.
    """
    return torch.diagonal(reference.ggn(model, loss_fn, params, X, y))
