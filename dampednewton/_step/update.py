r"""The parameter update of one step, given its direction (a functional kernel).

With the trust-region scaled direction ``νs``, momentum ``μ`` and decoupled weight
decay ``wd``:

.. math::

    m \leftarrow \mu m + \nu s, \quad
    \theta \leftarrow (1 - \mathrm{lr}\cdot\mathrm{wd})\,\theta + \mathrm{lr}\cdot m

(Nesterov: ``θ += lr·(νs + μm)``; without momentum ``m = νs`` and no buffer is kept).
The trust-region scale ``ν`` comes from
:func:`~dampednewton._step.quadratic_model.trust_region_scale`.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.group_result import GroupStep
from dampednewton._step.options import GroupOptions
from dampednewton._step.quadratic_model import trust_region_scale
from dampednewton.math.precision import computation_dtype

MOMENTUM = "momentum_buffer"


def update_parameter(
    param: Tensor, direction: Tensor, state: dict[str, Any], options: GroupOptions
) -> None:
    """Move one parameter in place (call under ``torch.no_grad()``).

    Args:
        param: The parameter.
        direction: Its scaled direction ``νs`` (any floating dtype).
        state: The parameter's optimizer state (holds the momentum buffer).
        options: The group's options (``lr``, ``momentum``, ``nesterov``,
            ``weight_decay``).
    """
    # Half-precision parameters keep their momentum in float32; ``add_`` rounds once.
    update = direction.to(computation_dtype(param.dtype))
    mu = options.momentum
    if mu > 0:
        buffer = state.get(MOMENTUM)
        if buffer is None:
            buffer = state[MOMENTUM] = update.clone()
        else:
            buffer.mul_(mu).add_(update)
        update = update.add(buffer, alpha=mu) if options.nesterov else buffer
    if options.weight_decay > 0:
        param.mul_(1 - options.lr * options.weight_decay)
    param.add_(update, alpha=options.lr)


def apply_steps(
    params: Sequence[Sequence[Tensor]],
    options: Sequence[GroupOptions],
    steps: Sequence[GroupStep | None],
    state: MutableMapping[Any, dict[str, Any]],
) -> list[Tensor | float]:
    """Move every group's parameters along its step, scaled to its trust region.

    Args:
        params: Per group, its parameters.
        options: Per group, its options.
        steps: Per group, its step (``None``: the group does not move).
        state: The optimizer's per-parameter state (momentum buffers).

    Returns:
        The trust-region scale ``ν`` of every group (1 for groups without a step).
    """
    scales: list[Tensor | float] = []
    with torch.no_grad():
        for group, option, step in zip(params, options, steps, strict=True):
            if step is None:
                scales.append(1.0)
                continue
            scale = trust_region_scale(step.slope, step.batch_curvature, option.kl_clip)
            scales.append(scale)
            for param, direction in zip(group, step.direction, strict=True):
                if param.requires_grad:
                    update_parameter(param, direction * scale, state[param], option)
    return scales


def apply_flat_step(
    params: Sequence[Tensor],
    direction: Tensor,
    state: MutableMapping[Any, dict[str, Any]],
    options: GroupOptions,
    scale: float = 1.0,
) -> None:
    """Move a group's parameters along a flat direction ``νs`` (under ``no_grad``).

    Args:
        params: The group's parameters.
        direction: ``s`` ``[D]``, the parameters' entries in order.
        state: The optimizer's per-parameter state (momentum buffers).
        options: The group's options.
        scale: ``ν`` (a number: the multi-tensor kernels take it as a factor).
    """
    pieces = [
        piece.view_as(p)
        for piece, p in zip(
            direction.split([p.numel() for p in params]), params, strict=True
        )
    ]
    update_parameters(
        [(p, piece) for p, piece in zip(params, pieces, strict=True)],
        state,
        options,
        scale,
    )


def update_parameters(
    pairs: Sequence[tuple[Tensor, Tensor]],
    state: MutableMapping[Any, dict[str, Any]],
    options: GroupOptions,
    scale: float,
) -> None:
    """Move parameters by ``ν`` times their directions (call under ``no_grad``).

    The update of :func:`update_parameter` with one multi-tensor operation per term
    (``torch._foreach_*``: the weight decay, the momentum buffers, the parameters)
    where every direction has its parameter's dtype and every buffer exists (from
    the second step with momentum on); otherwise parameter by parameter. Frozen
    parameters (``requires_grad=False``) and, as in ``torch.optim``, parameters
    without a gradient (unused by this step's forward pass) do not move.

    Args:
        pairs: ``(parameter, its direction s)``.
        state: The optimizer's per-parameter state (momentum buffers).
        options: The group's options.
        scale: ``ν``.
    """
    moving = [(p, d) for p, d in pairs if p.requires_grad and p.grad is not None]
    params = [p for p, _ in moving]
    directions = [d for _, d in moving]
    mu = options.momentum
    stored = [state[p].get(MOMENTUM) for p in params] if mu > 0 else []
    buffers: list[Tensor] = [b for b in stored if b is not None]
    same_dtypes = all(d.dtype == p.dtype for p, d in moving)
    if not params or not same_dtypes or len(buffers) < len(stored):
        for param, direction in moving:
            update_parameter(param, direction * scale, state[param], options)
        return
    if options.weight_decay > 0:
        torch._foreach_mul_(params, 1 - options.lr * options.weight_decay)
    if mu == 0:
        torch._foreach_add_(params, directions, alpha=options.lr * scale)
        return
    torch._foreach_mul_(buffers, mu)
    torch._foreach_add_(buffers, directions, alpha=scale)
    if options.nesterov:
        torch._foreach_add_(params, directions, alpha=options.lr * scale)
        torch._foreach_add_(params, buffers, alpha=options.lr * mu)
    else:
        torch._foreach_add_(params, buffers, alpha=options.lr)
