"""One host read per step: the device-side conditions that decide and record it.

A step's checks (is the loss finite, the curvature, the update; are a policy's
dampings valid; did a target equal ``ignore_index``) and its counts (directions
selected, how many of them with small eigenvalues, columns an averaged factor keeps)
stay 0-dim tensors while the step is computed. :func:`read_status` brings them all
to the host in one transfer: one synchronization per step, where reading each as it
is computed would wait for the device a dozen times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from dampednewton._step.group_result import AveragedFactor, GroupStep
from dampednewton.backpack.loss_checks import DeferredChecks, targets_error
from dampednewton.math.finite import finite_flag
from dampednewton.policies.damping_values import invalid_damping_error


@dataclass
class GroupStatus:
    """What the host needs to know about one group's step.

    Attributes:
        curvature_finite: Whether the batch's Gram matrix was finite.
        damping_valid: Whether the damping policy's values were valid.
        num_directions: Directions the criterion selected (recorded).
        small_eigenvalues: How many of them have an eigenvalue below the group's
            ``warn_small_eigvals`` (counted for steps from this batch's GGN only).
        complement_finite: Whether the complement's ``ρ`` is finite (an infinite
            one, from a policy without a direction to borrow it from, means no
            complement step).
        factor_rank: Positive weights of the updated averaged factor (``None``
            without one).
    """

    curvature_finite: bool
    damping_valid: bool
    num_directions: int
    small_eigenvalues: int
    complement_finite: bool
    factor_rank: int | None


@dataclass
class StepStatus:
    """What the host needs to know about a step, read in one transfer.

    Attributes:
        loss_finite: Whether the closure's loss is finite.
        step_finite: Whether every group's update direction is finite.
        ignored_targets: Targets equal to the cross-entropy's ``ignore_index``.
        model_output_finite: Whether the model output reaching the loss was finite
            (where a Monte-Carlo hook checked it).
        loss_unscaled: Whether the gradient reaching the loss was 1 (BackPACK's
            check that ``backward`` ran on the loss itself).
        groups: Per group, its status (``None`` for groups without a step).
    """

    loss_finite: bool
    step_finite: bool
    ignored_targets: int
    model_output_finite: bool
    loss_unscaled: bool
    groups: list[GroupStatus | None]

    def check_inputs(
        self, results: Sequence[GroupStep | None], deferred: DeferredChecks
    ) -> None:
        """Raise for invalid input that the step's checks found.

        Args:
            results: Per group, its step.
            deferred: The hooks' deferred checks (for the number of targets).

        Raises:
            ValueError: For targets equal to ``ignore_index`` or a damping policy's
                negative or NaN values.
        """
        if self.ignored_targets:
            raise targets_error(self.ignored_targets, deferred)
        for group, result in zip(self.groups, results, strict=True):
            if group is not None and result is not None and not group.damping_valid:
                raise invalid_damping_error(result.damping)


class _Reads:
    """0-dim tensors queued for one transfer; ``None`` entries keep a default."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def add(self, value: Tensor | None) -> int | None:
        if value is None:
            return None
        self.tensors.append(value.detach().reshape(()))
        return len(self.tensors) - 1


def read_status(
    loss: Tensor,
    results: Sequence[GroupStep | None],
    thresholds: Sequence[float],
    deferred: DeferredChecks,
) -> StepStatus:
    """Read every check and count of a step with a single host synchronization.

    Args:
        loss: The closure's loss.
        results: Per group, its step (``None``: no step).
        thresholds: Per group, its ``warn_small_eigvals``.
        deferred: Checks deferred by BackPACK's hooks.

    Returns:
        The step's status.
    """
    reads = _Reads()
    loss_slot = reads.add(finite_flag(loss.detach()))
    # The direction and what its trust-region scale is computed from.
    steps = [
        s
        for r in results
        if r is not None
        for s in (*r.direction, r.slope, r.batch_curvature)
        if s is not None
    ]
    step_slot = reads.add(finite_flag(*steps) if steps else None)
    group_slots = [
        None if result is None else _group_slots(reads, result, threshold)
        for result, threshold in zip(results, thresholds, strict=True)
    ]
    ignored_slot = reads.add(deferred.ignored_targets)
    output_slot = reads.add(deferred.model_output_finite)
    unscaled_slot = reads.add(deferred.loss_unscaled)
    device = loss.device
    values = torch.stack(
        [t.to(device=device, dtype=torch.float64) for t in reads.tensors]
    ).tolist()  # the step's one host synchronization

    def value(slot: int | None, default: float) -> float:
        return default if slot is None else values[slot]

    return StepStatus(
        loss_finite=bool(value(loss_slot, 1.0)),
        step_finite=bool(value(step_slot, 1.0)),
        ignored_targets=int(value(ignored_slot, 0.0)),
        model_output_finite=bool(value(output_slot, 1.0)),
        loss_unscaled=bool(value(unscaled_slot, 1.0)),
        groups=[
            None
            if slots is None
            else GroupStatus(
                curvature_finite=bool(value(slots[0], 1.0)),
                damping_valid=bool(value(slots[1], 1.0)),
                num_directions=int(value(slots[2], 0.0)),
                small_eigenvalues=int(value(slots[3], 0.0)),
                complement_finite=bool(value(slots[4], 1.0)),
                factor_rank=None if slots[5] is None else int(values[slots[5]]),
            )
            for slots in group_slots
        ],
    )


def _group_slots(
    reads: _Reads, result: GroupStep, threshold: float
) -> tuple[int | None, ...]:
    """Queue a group's checks and counts; return their slots."""
    small = None
    if threshold > 0 and result.factor is None:
        small = (result.selected & (result.evals.abs() < threshold)).sum()
    rho = result.complement_curvature
    return (
        reads.add(result.curvature_finite),
        reads.add(result.damping_valid),
        reads.add(result.selected.sum()),
        reads.add(small),
        reads.add(None if rho is None else torch.isfinite(rho)),
        reads.add(None if result.factor is None else (result.factor.weights > 0).sum()),
    )


def settled(result: GroupStep | None, status: GroupStatus | None) -> GroupStep | None:
    """A group's step as recorded, once its counts are known on the host.

    The fixed-size computation may carry non-selected directions (the non-positive
    ones of a :class:`~dampednewton.policies.criteria.TopK` tail) and zero columns
    of an averaged factor; both come first, so slicing drops them without a copy.
    An infinite complement curvature (no direction to borrow it from) is recorded
    as ``None``: no complement step. The update direction is unchanged.

    Args:
        result: The group's step.
        status: Its status.

    Returns:
        The step with its recorded quantities trimmed.
    """
    if result is None or status is None:
        return result
    start = result.evals.numel() - status.num_directions
    factor, frozen = result.factor, result.frozen
    if factor is not None and status.factor_rank is not None:
        first = factor.weights.numel() - status.factor_rank
        if first:
            # Copies: the state dict must not keep the dropped columns' storage.
            factor = AveragedFactor(
                tuple(b[first:].clone() for b in factor.basis),
                factor.weights[first:].clone(),
                factor.updates,
            )
            if frozen is not None:
                frozen = frozen.without_first(first)
    return replace(
        result,
        evals=result.evals[start:],
        gamma_mean=result.gamma_mean[start:],
        lambda_mean=result.lambda_mean[start:],
        damping=result.damping[start:],
        coefficients=result.coefficients[start:],
        selected=result.selected[start:],
        complement_curvature=(
            result.complement_curvature if status.complement_finite else None
        ),
        factor=factor,
        frozen=frozen,
    )
