r"""The parameter update of one step, given its direction (a functional kernel).

With the trust-region scaled direction ``νs``, momentum ``μ`` and decoupled weight
decay ``wd``:

.. math::

    m \leftarrow \mu m + \nu s, \quad
    \theta \leftarrow (1 - \mathrm{lr}\cdot\mathrm{wd})\,\theta + \mathrm{lr}\cdot m

(Nesterov: ``θ += lr·(νs + μm)``; without momentum ``m = νs`` and no buffer is kept).
With :class:`~dampednewton.ScheduleFree` as the momentum, the parameters hold
``y = (1 − β) z + β x`` of a fast iterate ``z`` and its average ``x``: with the step
``Δ = lr·νs − lr·wd·y``

.. math::

    y \leftarrow (1 - c)\,y + c\,z + (1 - \beta(1 - c))\,\Delta, \quad
    z \leftarrow z + \Delta

(:func:`schedule_free_update`: ``x = (y − (1 − β) z)/β`` is never stored). The
trust-region scale ``ν`` comes from
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
from dampednewton.policies.schedule_free import ScheduleFree

MOMENTUM = "momentum_buffer"
FAST_ITERATE = "schedule_free_iterate"
"""Schedule-Free's fast iterate ``z`` (the parameters hold ``y``)."""
AVERAGED_STEPS = "step"
"""Schedule-Free's count of a parameter's steps: an int64 CPU tensor under Adam's key,
which torch's ``load_state_dict`` leaves where it is (reading it syncs no device)."""


def schedule_free_update(
    param: Tensor, fast: Tensor, update: Tensor, interpolation: float, weight: float
) -> None:
    """One Schedule-Free step of ``y`` (``param``) and ``z`` (``fast``), in place.

    With ``x`` the average and ``y = (1 − β) z + β x``, the step ``z' = z + Δ``,
    ``x' = (1 − c) x + c z'`` gives ``y' = (1 − c) y + c z + (1 − β(1 − c)) Δ``.

    Args:
        param: ``y``.
        fast: ``z`` (``param``'s dtype).
        update: ``Δ``.
        interpolation: ``β``.
        weight: ``c``.
    """
    param.lerp_(fast, weight).add_(update, alpha=1 - interpolation * (1 - weight))
    fast.add_(update)


def _averaged_weight(
    state: dict[str, Any], param: Tensor, policy: ScheduleFree
) -> float:
    """Count a Schedule-Free step of ``param`` (its iterate created at the first)."""
    if FAST_ITERATE not in state:
        state[FAST_ITERATE] = param.detach().to(computation_dtype(param.dtype)).clone()
        state[AVERAGED_STEPS] = torch.zeros((), dtype=torch.int64)
    steps = state[AVERAGED_STEPS]
    steps += 1
    return policy.weight(int(steps.item()))


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
    if isinstance(mu, ScheduleFree):
        weight = _averaged_weight(state, param, mu)
        fast = state[FAST_ITERATE]
        point = param.detach().to(fast.dtype)
        update = update * options.lr
        if options.weight_decay > 0:
            update.add_(point, alpha=-options.lr * options.weight_decay)
        if point.dtype == param.dtype:
            schedule_free_update(param, fast, update, mu.interpolation, weight)
        else:  # a half-precision parameter: y in float32, rounded once
            schedule_free_update(point, fast, update, mu.interpolation, weight)
            param.copy_(point)
        return
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
    if isinstance(mu, ScheduleFree):
        _schedule_free_updates(moving, state, options, scale, mu)
        return
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


def _schedule_free_updates(
    moving: Sequence[tuple[Tensor, Tensor]],
    state: MutableMapping[Any, dict[str, Any]],
    options: GroupOptions,
    scale: float,
    policy: ScheduleFree,
) -> None:
    """:func:`schedule_free_update` of each parameter, multi-tensor per weight ``c``.

    Parameters of one group share their count of steps unless some missed steps
    (unused by a forward pass): each count's parameters move together.
    """
    if any(
        d.dtype != p.dtype or computation_dtype(p.dtype) != p.dtype for p, d in moving
    ):
        for param, direction in moving:
            update_parameter(param, direction * scale, state[param], options)
        return
    by_weight: dict[float, list[tuple[Tensor, Tensor]]] = {}
    for param, direction in moving:
        weight = _averaged_weight(state[param], param, policy)
        by_weight.setdefault(weight, []).append((param, direction))
    lr, decay = options.lr, options.weight_decay
    for weight, pairs in by_weight.items():
        params = [p for p, _ in pairs]
        fast = [state[p][FAST_ITERATE] for p in params]
        updates = torch._foreach_mul([d for _, d in pairs], lr * scale)
        if decay > 0:
            torch._foreach_add_(updates, params, alpha=-lr * decay)
        torch._foreach_lerp_(params, fast, weight)
        interpolated = 1 - policy.interpolation * (1 - weight)
        torch._foreach_add_(params, updates, alpha=interpolated)
        torch._foreach_add_(fast, updates)
