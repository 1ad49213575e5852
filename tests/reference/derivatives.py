"""Brute-force losses, gradients, Jacobians and Hessians (conventions: package doc)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from tests.reference.validation import check_outputs, parameter_names


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate tensors, each flattened, into one vector.

    Args:
        tensors: Tensors in parameter-group order.

    Returns:
        Vector of length ``Σ t.numel()``.

    Raises:
        ValueError: If ``tensors`` is empty.
    """
    if len(tensors) == 0:
        raise ValueError("Cannot flatten an empty list of tensors.")
    return torch.cat([t.flatten() for t in tensors])


def unflatten(vec: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """Split a vector into tensors shaped like ``params`` (inverse of ``flatten``).

    Args:
        vec: Vector of length ``Σ p.numel()``.
        params: Tensors whose shapes define the split.

    Returns:
        Views of ``vec``, one per entry of ``params``, with the same shapes.

    Raises:
        ValueError: If ``vec`` is not a vector of the right length.
    """
    sizes = [p.numel() for p in params]
    if vec.dim() != 1 or vec.numel() != sum(sizes):
        raise ValueError(
            f"Expected a vector of length {sum(sizes)} (the group's parameter "
            f"count), got shape {tuple(vec.shape)}."
        )
    return [
        chunk.view(p.shape)
        for chunk, p in zip(torch.split(vec, sizes), params, strict=True)
    ]


def per_sample_loss(loss_fn: nn.Module, output: Tensor, target: Tensor) -> Tensor:
    """Loss of one sample, ``ℓ_n(f_n) = loss_fn(f_n.unsqueeze(0), y_n.unsqueeze(0))``.

    Args:
        loss_fn: Loss module with ``reduction="mean"``.
        output: Model output of one sample, shape ``[C]``.
        target: Target of that sample (``[]`` class index or ``[C]`` values).

    Returns:
        Scalar loss.
    """
    return loss_fn(output.unsqueeze(0), target.unsqueeze(0))


def per_sample_losses(loss_fn: nn.Module, outputs: Tensor, targets: Tensor) -> Tensor:
    """Losses ``ℓ_n`` of all samples; their mean is ``loss_fn(outputs, targets)``.

    Args:
        loss_fn: Loss module with ``reduction="mean"``.
        outputs: Model outputs, shape ``[N, C]``.
        targets: Targets, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N]``.
    """
    check_outputs(outputs, targets)
    return torch.stack(
        [per_sample_loss(loss_fn, f, y) for f, y in zip(outputs, targets, strict=True)]
    )


def output_jacobians(model: nn.Module, params: Sequence[Tensor], X: Tensor) -> Tensor:
    """Jacobians ``J_n = ∂f_n/∂θ`` of the outputs w.r.t. a parameter group.

    Parameters outside the group are held fixed.

    Args:
        model: Model mapping ``X`` to outputs of shape ``[N, C]``.
        params: Parameter group (parameters of ``model``, no duplicates).
        X: Inputs, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N, C, D]``.

    Raises:
        ValueError: If the outputs are not of shape ``[N, C]``.
    """
    names = parameter_names(model, params)

    def outputs_of(theta: Tensor) -> Tensor:
        overrides = dict(zip(names, unflatten(theta, params), strict=True))
        return functional_call(model, overrides, (X.detach(),))

    theta = flatten([p.detach() for p in params])
    jacobians = jacrev(outputs_of)(theta).detach()
    if jacobians.dim() != 3 or jacobians.shape[0] != X.shape[0]:
        raise ValueError(
            "Model outputs must have shape [N, C]; got Jacobian of shape "
            f"{tuple(jacobians.shape)} for {X.shape[0]} samples."
        )
    return jacobians


def loss_hessians(loss_fn: nn.Module, outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample loss Hessians ``H_n = ∇²_f ℓ_n`` w.r.t. the model output.

    Args:
        loss_fn: Loss module with ``reduction="mean"``.
        outputs: Model outputs, shape ``[N, C]``.
        targets: Targets, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N, C, C]``.
    """
    check_outputs(outputs, targets)
    hessians = []
    for f, y in zip(outputs.detach(), targets, strict=True):

        def loss_of(output: Tensor, target: Tensor = y) -> Tensor:
            return per_sample_loss(loss_fn, output, target)

        hessians.append(torch.autograd.functional.hessian(loss_of, f))
    return torch.stack(hessians)


def per_sample_gradients(
    model: nn.Module,
    loss_fn: nn.Module,
    params: Sequence[Tensor],
    X: Tensor,
    y: Tensor,
) -> Tensor:
    """Per-sample gradients ``∇_θ ℓ_n``, one forward-backward pass per sample.

    Note the scale: their mean is the gradient of the mean loss (BackPACK's
    ``BatchGrad`` stores ``∇ℓ_n / N`` instead).

    Args:
        model: Model mapping ``X`` to outputs of shape ``[N, C]``.
        loss_fn: Loss module with ``reduction="mean"``.
        params: Parameter group.
        X: Inputs, leading dimension ``N``.
        y: Targets, leading dimension ``N``.

    Returns:
        Tensor of shape ``[N, D]``.
    """
    parameter_names(model, params)
    gradients = []
    for n in range(X.shape[0]):
        outputs = model(X[n : n + 1])
        check_outputs(outputs, y[n : n + 1])
        loss = per_sample_loss(loss_fn, outputs[0], y[n])
        gradients.append(flatten(torch.autograd.grad(loss, list(params))))
    return torch.stack(gradients)


def hessian_diagonal(
    model: nn.Module, loss_fn: nn.Module, params: list[Tensor], X: Tensor, y: Tensor
) -> Tensor:
    """Diagonal of the mean loss's full Hessian (an autograd loop over its rows).

    Returns:
        Vector over the concatenated ``params``.
    """
    names = parameter_names(model, params)

    def loss_of(theta: Tensor) -> Tensor:
        overrides = dict(zip(names, unflatten(theta, params), strict=True))
        return loss_fn(functional_call(model, overrides, (X,)), y)

    theta = flatten([p.detach() for p in params])
    return torch.diagonal(torch.autograd.functional.hessian(loss_of, theta)).detach()
