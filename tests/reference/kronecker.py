"""Brute-force Kronecker factors of a layer's exact GGN and K-FAC's damped step.

The factors come from a plain (not BackPACK-extended) model: the layer's input by a
forward hook, unfolded with ``torch.nn.functional.unfold`` for convolutions, and the
Jacobians of the model output with respect to the layer's output by autograd, one
backward pass per output column. For a layer ``z = W x̃`` shared over ``P`` positions:

* ``A = (1/N) Σ_n Σ_p x̃_np x̃_npᵀ`` (``x̃`` ends with a 1 when the layer has a bias);
* ``S = (1/N) Σ_n Σ_p J_npᵀ H_n J_np`` with ``J_np = ∂f_n/∂z_np`` ``[C, d_out]``
  and ``H_n`` the loss Hessian with respect to the output ``f_n`` (both factors sum
  over the positions).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.reference.derivatives import loss_hessians


def _patches(layer: nn.Module, inputs: Tensor) -> Tensor:
    """The layer's inputs per output position ``[N, P, d_in]``."""
    if isinstance(layer, nn.Linear):
        return inputs.reshape(inputs.shape[0], -1, inputs.shape[-1])
    if isinstance(layer, nn.Conv1d):
        unfolded = F.unfold(
            inputs.unsqueeze(2),
            (1, layer.kernel_size[0]),
            dilation=(1, layer.dilation[0]),
            padding=(0, layer.padding[0]),
            stride=(1, layer.stride[0]),
        )
    elif isinstance(layer, nn.Conv2d):
        unfolded = F.unfold(
            inputs,
            layer.kernel_size,
            dilation=layer.dilation,
            padding=layer.padding,
            stride=layer.stride,
        )
    else:
        raise TypeError(f"No Kronecker factors for {layer}.")
    return unfolded.transpose(1, 2)


def _positions_last(layer: nn.Module, tensor: Tensor) -> Tensor:
    """An output-shaped ``[N, C, *z]`` tensor as ``[N, C, P, d_out]``."""
    if isinstance(layer, nn.Linear):
        return tensor.reshape(*tensor.shape[:2], -1, tensor.shape[-1])
    return tensor.flatten(start_dim=3).transpose(2, 3)


def kronecker_factors(
    model: nn.Module,
    loss_fn: nn.Module,
    layer: nn.Module,
    X: Tensor,
    y: Tensor,
    bias: bool = True,
    samples: list[int] | None = None,
    hessians: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(A, S)`` of ``layer`` in ``model`` for the exact GGN on ``(X, y)``.

    Args:
        model: Plain model mapping ``X`` to ``[N, C]`` outputs.
        loss_fn: Plain loss function with ``reduction="mean"``.
        layer: A ``nn.Linear``, ``nn.Conv1d`` or ``nn.Conv2d`` of ``model``.
        X: Inputs.
        y: Targets.
        bias: Append the bias's 1 to the inputs.
        samples: The samples the means are over (``None``: all).
        hessians: ``[N, C, C]`` in place of the loss Hessians (a Monte-Carlo
            estimate's outer products; ``None``: the exact ones).

    Returns:
        The input factor ``A`` and the output factor ``S``.
    """
    captured: dict[str, Tensor] = {}

    def capture(module, inputs, output):
        captured["inputs"] = inputs[0].detach()
        captured["output"] = output

    handle = layer.register_forward_hook(capture)
    try:
        outputs = model(X)
    finally:
        handle.remove()
    jacobians = torch.stack(
        [
            torch.autograd.grad(
                outputs[:, c].sum(), captured["output"], retain_graph=True
            )[0]
            for c in range(outputs.shape[1])
        ],
        dim=1,
    )  # [N, C, *z]: samples do not mix, so each row is ∂f_n,c/∂z_n
    jacobians = _positions_last(layer, jacobians)
    if hessians is None:
        hessians = loss_hessians(loss_fn, outputs.detach(), y)
    patches = _patches(layer, captured["inputs"])
    if bias:
        patches = torch.cat([patches, patches.new_ones(*patches.shape[:2], 1)], dim=2)
    if samples is not None:
        jacobians, hessians, patches = (
            jacobians[samples],
            hessians[samples],
            patches[samples],
        )
    num_samples = patches.shape[0]
    inputs = torch.einsum("npi,npj->ij", patches, patches) / num_samples
    outputs_factor = (
        torch.einsum("ncpo,ncd,ndpk->ok", jacobians, hessians, jacobians) / num_samples
    )
    return inputs, outputs_factor


def kfac_direction(
    inputs: Tensor, outputs: Tensor, gradient: Tensor, damping: float
) -> Tensor:
    """K-FAC's step ``−(S + √δ/π I)⁻¹ Ḡ (A + π√δ I)⁻¹`` with ``π`` from the traces.

    Args:
        inputs: ``A`` ``[d_in, d_in]``.
        outputs: ``S`` ``[d_out, d_out]``.
        gradient: ``Ḡ`` ``[d_out, d_in]``.
        damping: ``δ``.

    Returns:
        The step as a ``[d_out, d_in]`` matrix.
    """
    pi = math.sqrt(
        (torch.trace(inputs) / inputs.shape[0])
        / (torch.trace(outputs) / outputs.shape[0])
    )
    root = math.sqrt(damping)
    left = outputs + root / pi * torch.eye(outputs.shape[0], dtype=outputs.dtype)
    right = inputs + root * pi * torch.eye(inputs.shape[0], dtype=inputs.dtype)
    return -torch.linalg.solve(left, gradient) @ torch.linalg.inv(right)


def kfac_model(
    inputs: Tensor, outputs: Tensor, gradient: Tensor, direction: Tensor
) -> tuple[Tensor, Tensor]:
    """The slope ``ḡᵀs`` and the curvature ``sᵀ(S ⊗ A)s`` of a step, densely."""
    flat_direction = direction.flatten()
    dense = torch.kron(outputs.contiguous(), inputs.contiguous())
    curvature = flat_direction @ dense @ flat_direction
    return gradient.flatten() @ flat_direction, curvature


def power_rotation(factor: Tensor, values: Tensor, vectors: Tensor) -> Tensor:
    """One subspace iteration from eigenvectors, orthonormalized by Gram-Schmidt.

    The vectors ``[d, r]`` ordered by ``values``, largest first, are multiplied by
    ``factor``; classical Gram-Schmidt, column by column, gives an orthonormal basis
    whose first ``k`` columns span the first ``k`` products (the property QR's
    ``Q`` has). Returned in the reverse order (ascending by the previous values),
    each column's sign undetermined (QR may flip it).
    """
    ordered = vectors[:, torch.argsort(values, descending=True)]
    products = factor @ ordered
    basis: list[Tensor] = []
    for column in products.T:
        for previous in basis:
            column = column - (previous @ column) * previous
        basis.append(column / column.norm())
    return torch.stack(basis[::-1], dim=1)
