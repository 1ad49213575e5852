"""Plain-twin references for the Kronecker basis' tests: factors, gradients, steps.

Each helper acts on a :class:`tests.utils.Case`'s reference model (not extended),
with the brute-force factors and damped step of :mod:`tests.reference.kronecker`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dampednewton import KroneckerBasis
from tests.assertions import assert_close
from tests.reference.kronecker import kfac_direction, kronecker_factors
from tests.utils import Case

LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)
FULL_RANK = KroneckerBasis(exact_size=1000)
"""Every factor of the test problems decomposed exactly."""
EXACT = {
    "mc_samples": 0,
    "basis": FULL_RANK,
    "kl_clip": None,
    "momentum": 0.0,
    "weight_decay": 0.0,
}


def layers_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, LAYERS)]


def gradient_matrix(layer: nn.Module, bias: bool = True) -> Tensor:
    parts = [layer.weight.grad.reshape(layer.weight.shape[0], -1)]
    if bias and layer.bias is not None:
        parts.append(layer.bias.grad[:, None])
    return torch.cat(parts, dim=1)


def reference_gradients(case: Case) -> None:
    """Fill the reference model's ``.grad`` with the mean loss's gradient."""
    case.reference_model.zero_grad()
    case.reference_loss_fn(case.reference_model(case.X), case.y).backward()


def reference_factors(case: Case) -> list[tuple[Tensor, Tensor]]:
    return [
        kronecker_factors(
            case.reference_model, case.reference_loss_fn, layer, case.X, case.y
        )
        for layer in layers_of(case.reference_model)
    ]


def apply_reference(case: Case, factors, damping: float, scale: float = 1.0) -> None:
    """Move the reference model by ``scale`` times K-FAC's step from ``factors``."""
    reference_gradients(case)
    with torch.no_grad():
        for layer, (inputs, outputs) in zip(
            layers_of(case.reference_model), factors, strict=True
        ):
            step = kfac_direction(inputs, outputs, gradient_matrix(layer), damping)
            width = layer.weight[0].numel()
            layer.weight += scale * step[:, :width].reshape(layer.weight.shape)
            layer.bias += scale * step[:, width]


def assert_models_close(case: Case, rtol: float = 1e-9) -> None:
    for index, (actual, expected) in enumerate(
        zip(case.model.parameters(), case.reference_model.parameters(), strict=True)
    ):
        assert_close(actual, expected, rtol=rtol, atol=1e-11, name=f"param {index}")
