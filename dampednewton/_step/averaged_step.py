"""A group's step along its averaged factor ``B`` (:mod:`dampednewton.averaging`).

:func:`averaged_step` refreshes the factor with this batch's square root (or keeps
it between refreshes) and takes the step along its leading eigen-directions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.group_result import AveragedFactor, GroupStep
from dampednewton._step.step_block import StepBlock
from dampednewton.math.averaged_gram import bias_corrected
from dampednewton.math.complement import (
    complement_coefficients,
    complement_rayleigh_quotient,
    orthogonal_energy,
    squared_norm,
)
from dampednewton.math.frozen_basis import freeze
from dampednewton.math.gram_space import newton_coefficients
from dampednewton.math.precision import computation_dtype, upcast
from dampednewton.policies.criteria import selected_indices, top_k_start
from dampednewton.policies.damping import Damping
from dampednewton.policies.damping_values import (
    checked_damping_shape,
    trusts_its_values,
    valid_damping_flag,
)


def empty_factor(params: Sequence[Tensor], like: Tensor) -> AveragedFactor:
    """The factor of no batch: ``r = 0`` columns.

    Args:
        params: The group's parameters.
        like: A tensor of the eigenvalues' dtype and device.

    Returns:
        An :class:`AveragedFactor` with ``updates = 0``.
    """
    basis = tuple(
        p.new_zeros(0, *p.shape, dtype=computation_dtype(p.dtype)) for p in params
    )
    return AveragedFactor(basis, like.new_zeros(0), 0)


def averaged_step(
    group: StepBlock,
    factor: AveragedFactor,
    batch_products: Tensor | None = None,
    mean_products: Tensor | None = None,
) -> GroupStep:
    """The damped Newton (and complement) step along an averaged factor's directions.

    Directions ``u_i = B_i/√w_i`` with curvatures ``λ_i = w_i/(1 − β^t)`` (the
    bias-corrected average), slopes ``γ̄_i = ḡᵀu_i`` from the parameters' ``.grad``.
    Damping policies see ``gammas = γ̄[None]`` and ``lambdas = λ[None]`` and no Gram
    eigenvectors (``[0, K]``). The quadratic model's curvature is the average's: along
    the chosen directions and, for the complement step, along the factor's
    directions the criterion left out (zero beyond the factor). On a refresh, this
    batch's ``VᵀB`` and ``Vᵀḡ`` give the curvature ``sᵀVVᵀs`` of the batch's GGN
    along the step as well.

    Args:
        group: The group (its options have ``averaging``).
        factor: The averaged factor (``updates >= 1``).
        batch_products: ``VᵀB`` ``[C·N, r]`` of this batch's square root, if any.
        mean_products: ``Vᵀḡ`` ``[C·N]`` (with ``batch_products``).

    Returns:
        The group's step, carrying ``factor``.
    """
    options = group.options
    assert options.averaging is not None  # only averaged groups have a factor
    all_evals = bias_corrected(factor.weights, options.averaging.decay, factor.updates)
    criterion = options.criterion
    start = top_k_start(criterion, all_evals.numel())
    chosen: int | Tensor = (
        selected_indices(criterion, all_evals) if start is None else start
    )
    evals = _entries(all_evals, chosen)
    weights = _entries(factor.weights, chosen)
    columns = [_entries(basis, chosen) for basis in factor.basis]
    # A fresh factor holds zero weights (and columns) where the average was not
    # positive: they get a zero coefficient.
    positive = weights > 0
    norms = weights.sqrt().where(positive, 1.0)
    gradients = group_gradients(group.params)
    projections = (
        sum(
            (c.flatten(1) @ g.flatten().to(c))
            for c, g in zip(columns, gradients, strict=True)
        )
        / norms
    )
    damping, valid = checked_policy_damping(
        options.damping,
        evals,
        evals.new_zeros(0, evals.numel()),
        projections[None],
        evals[None],
    )
    coefficients = options.newton_fraction * newton_coefficients(
        projections, evals, damping
    ).where(positive, 0.0)
    policy = options.complement
    energy = orthogonal_energy(squared_norm(gradients), projections)
    measured = None
    if policy is not None and batch_products is not None and mean_products is not None:
        # Vᵀg_⊥ = Vᵀḡ − Σ_i p_i Vᵀu_i: the batch GGN's curvature in the complement.
        chosen_products = _entries(batch_products.T, chosen).T
        residual = mean_products - chosen_products @ (projections / norms)
        measured = complement_rayleigh_quotient(residual, energy)
    rho = (
        None
        if policy is None
        else policy(evals, damping.where(positive, torch.inf), measured)
    )
    slope = torch.sum(projections * coefficients)
    batch_curvature = None
    outside: Tensor | float = 0.0  # the model's curvature off the chosen directions
    if rho is None:
        weights = coefficients / norms
        direction = tuple(torch.tensordot(weights.to(c), c, dims=1) for c in columns)
        if batch_products is not None:
            chosen_products = _entries(batch_products.T, chosen).T
            batch_curvature = (chosen_products @ weights).square().sum()
    else:
        rho = rho.to(evals)
        weights = complement_coefficients(coefficients, projections, rho) / norms
        direction = tuple(
            torch.tensordot(weights.to(c), c, dims=1) - g / rho
            for c, g in zip(columns, gradients, strict=True)
        )
        slope = slope - energy / rho
        outside = _unchosen_curvature(factor, all_evals, chosen, gradients, rho)
        if batch_products is not None and mean_products is not None:
            chosen_products = _entries(batch_products.T, chosen).T
            mapped = chosen_products @ weights - mean_products / rho
            batch_curvature = mapped.square().sum()
    return GroupStep(
        direction=direction,
        frozen=freeze(
            factor.weights,
            all_evals,
            _spread(damping, chosen, all_evals.numel(), torch.inf),
            _spread(positive, chosen, all_evals.numel(), False),
            options.newton_fraction,
            rho,
            _excess(slope, batch_curvature),
        ),
        evals=evals,
        gamma_mean=projections,
        lambda_mean=evals,
        damping=damping,
        coefficients=coefficients,
        slope=slope,
        curvature=torch.sum(evals * coefficients**2) + outside,
        batch_curvature=batch_curvature,
        complement_curvature=rho,
        selected=positive,
        damping_valid=valid,
        factor=factor,
    )


def _unchosen_curvature(
    factor: AveragedFactor,
    all_evals: Tensor,
    chosen: int | Tensor,
    gradients: Sequence[Tensor],
    rho: Tensor,
) -> Tensor:
    """``Σ_j λ_j (ḡᵀu_j / ρ)²`` over the factor's directions the criterion left out.

    The complement step ``−g_⊥/ρ`` has the component ``−ḡᵀu_j/ρ`` along each of them,
    where the averaged GGN has the curvature ``λ_j``: the quadratic model's share
    of those directions (zero when every direction of the factor is chosen). No
    host read: the left-out directions are a mask.
    """
    positive = factor.weights > 0
    left_out = positive.clone()
    if isinstance(chosen, int):
        left_out[chosen:] = False
    else:
        left_out[chosen] = False
    norms = factor.weights.sqrt().where(positive, 1.0)
    projections = (
        sum(
            (basis.flatten(1) @ g.flatten().to(basis))
            for basis, g in zip(factor.basis, gradients, strict=True)
        )
        / norms
    )
    terms = all_evals * (projections / rho) ** 2
    return terms.where(left_out, 0.0).sum()


def _entries(tensor: Tensor, chosen: int | Tensor) -> Tensor:
    """Rows ``tensor[chosen:]`` (a top-k tail, a view) or ``tensor[chosen]``."""
    if isinstance(chosen, int):
        return tensor[chosen:]
    return tensor.index_select(0, chosen)


def _excess(slope: Tensor, batch_curvature: Tensor | None) -> Tensor:
    """``η = max(1, sᵀĜs / (−ḡᵀs))``: the batch GGN's excess over the model."""
    if batch_curvature is None:
        return torch.ones_like(slope)
    model = (-slope).clamp_min(torch.finfo(slope.dtype).tiny)
    return (batch_curvature.to(model) / model).clamp_min(1.0)


def _spread(values: Tensor, chosen: int | Tensor, size: int, fill: Any) -> Tensor:
    """``values`` of the chosen entries at their places in ``[size]``, else ``fill``."""
    spread = values.new_full((size,), fill)
    if isinstance(chosen, int):
        spread[chosen:] = values
    else:
        spread[chosen] = values
    return spread


def checked_policy_damping(
    policy: Damping, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The policy's damping ``[K]`` and, unless valid by construction, its check.

    The shape is checked at once (known on the host); the values' check is a 0-dim
    tensor read with the step's other checks (see
    :mod:`dampednewton._step.step_status`).
    """
    values = checked_damping_shape(
        policy(evals, gram_evecs, gammas, lambdas), evals.numel()
    ).to(evals)
    return values, None if trusts_its_values(policy) else valid_damping_flag(values)


def group_gradients(params: Sequence[Tensor]) -> list[Tensor]:
    """The parameters' ``.grad`` in the computation dtype (zeros for frozen ones)."""
    return [
        torch.zeros_like(p, dtype=computation_dtype(p.dtype))
        if p.grad is None or not p.requires_grad
        else upcast(p.grad)
        for p in params
    ]
