"""The steps between curvature refreshes: a frozen basis, one plain backward pass.

A refresh (a BackPACK pass that updates a group's averaged factor ``B``, see
:mod:`dampednewton.averaging`) leaves the group the coefficients of
:mod:`dampednewton.math.frozen_basis` in ``records['groups'][i]['frozen_basis']``.
Until the group's next refresh (``CurvatureAveraging.interval``) its step needs only
the mean gradient ``ḡ``: two products with ``B`` and an update of Adam's size, after
a backward pass with BackPACK's hooks suspended
(:class:`~dampednewton.backpack.hooks.ExtendedModules`).

:func:`frozen_group_step` gives such a step as a :class:`GroupStep` for the general
pipeline (steps with a diagnostics monitor or data parallelism);
:class:`FrozenBases` keeps each group's ``B`` as one ``[r, D]`` matrix for the lean
path of :meth:`DampedNewton.step <dampednewton.DampedNewton.step>`, which computes the
same step with the same kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.group_result import GroupStep
from dampednewton._step.options import GroupOptions
from dampednewton._step.records import (
    BASIS,
    FROZEN,
    GLOBAL,
    GROUPS,
    REFRESH_DUE,
    refreshes_at,
)
from dampednewton.math.frozen_basis import (
    BasisStep,
    FrozenBasis,
    frozen_basis_step,
    guarded_curvature,
)


def stored_frozen(stats: Mapping[str, Any]) -> FrozenBasis | None:
    """A group's frozen coefficients from its statistics (``None`` before a refresh).

    Args:
        stats: The group's statistics (``optimizer.records['groups'][i]``).

    Returns:
        The coefficients, or ``None``.
    """
    entries = stats.get(FROZEN)
    return None if entries is None else FrozenBasis(**entries)


def gradient_vector(params: Sequence[Tensor], like: Tensor) -> Tensor:
    """The parameters' ``.grad`` as one vector of ``like``'s dtype (zeros if absent).

    Args:
        params: The group's parameters.
        like: A tensor of the basis' dtype and device.

    Returns:
        ``ḡ`` ``[D]``.
    """
    return torch.cat(
        [
            like.new_zeros(p.numel())
            if p.grad is None or not p.requires_grad
            else p.grad.reshape(-1).to(like.dtype)
            for p in params
        ]
    )


class FrozenBases:
    """Each group's ``B`` as one ``[r, D]`` matrix, built once per refresh."""

    def __init__(self) -> None:
        """Start empty."""
        self._bases: dict[int, Tensor] = {}

    def clear(self) -> None:
        """Forget every matrix (after a refresh or loading a state)."""
        self._bases.clear()

    def get(self, index: int, state: Mapping, params: Sequence[Tensor]) -> Tensor:
        """Group ``index``'s ``B`` ``[r, D]`` from the per-parameter columns.

        Args:
            index: The group's index.
            state: The optimizer's state (per parameter: the columns of ``B``).
            params: The group's parameters.

        Returns:
            The matrix.
        """
        basis = self._bases.get(index)
        if basis is None:
            basis = torch.cat([state[p][BASIS].flatten(1) for p in params], dim=1)
            self._bases[index] = basis
        return basis


def trust_bound(kl_clip: float | None) -> float | None:
    """``2κ``, the trust region's bound on the curvature (``None``: off)."""
    return None if kl_clip is None else 2 * kl_clip


def record_step_lengths(
    stats: Sequence[dict[str, Any]],
    results: Sequence[GroupStep | None],
    scales: Sequence[Tensor | float],
) -> None:
    """Store each refreshed group's step length ``ν‖s‖`` with its frozen coefficients.

    Args:
        stats: Per group, its statistics (updated in place).
        results: Per group, its accepted step.
        scales: Per group, its trust-region scale ``ν``.
    """
    for group, result, scale in zip(stats, results, scales, strict=True):
        if result is not None and result.factor is not None and FROZEN in group:
            squares = sum(part.square().sum() for part in result.direction)
            length = torch.as_tensor(scale) * torch.as_tensor(squares).sqrt()
            group[FROZEN]["step_length"] = length.to(group[FROZEN]["weights"])


def frozen_group_step(
    params: Sequence[Tensor], basis: Tensor, frozen: FrozenBasis, bound: float | None
) -> GroupStep:
    """A group's step along its frozen basis, as the general pipeline records it.

    Args:
        params: The group's parameters (their ``.grad`` is ``ḡ``).
        basis: ``B`` ``[r, D]``.
        frozen: The group's frozen coefficients.
        bound: The trust region's ``2κ`` (``None``: off).

    Returns:
        The step; its recorded directions are the kept columns.
    """
    result: BasisStep = frozen_basis_step(basis, gradient_vector(params, basis), frozen)
    kept = frozen.kept
    slopes = result.projections / frozen.weights.where(kept, 1.0).sqrt()
    return GroupStep(
        direction=tuple(
            piece.view_as(p)
            for piece, p in zip(
                result.direction.split([p.numel() for p in params]), params, strict=True
            )
        ),
        evals=frozen.curvatures,
        gamma_mean=slopes.where(kept, 0.0),
        lambda_mean=frozen.curvatures,
        damping=frozen.damping,
        coefficients=frozen.newton * slopes.where(kept, 0.0),
        slope=result.slope,
        curvature=result.curvature(frozen),
        batch_curvature=guarded_curvature(result, frozen, bound),
        selected=kept,
        complement_curvature=frozen.inverse_complement.reciprocal(),
    )


def between_refreshes(
    options: Sequence[GroupOptions], records: Mapping[str, Any], step: int
) -> bool:
    """Whether every group steps along its frozen basis (no refresh is due).

    Args:
        options: Every group's options.
        records: The optimizer's records (counters, group statistics).
        step: The step's index.

    Returns:
        ``True`` when no group refreshes its averaged curvature at ``step``.
    """
    stats = records.get(GROUPS)
    if not stats or records[GLOBAL].get(REFRESH_DUE, False):
        return False
    return all(
        option.averaging is not None
        and FROZEN in group
        and not refreshes_at(option.averaging, group, step)
        for option, group in zip(options, stats, strict=True)
    )
