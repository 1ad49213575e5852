"""What a step leaves behind: per-group statistics and ``newton/*`` diagnostics.

``optimizer.records['groups'][i]`` holds group ``i``'s last step (eigenvalues, mean
slopes and curvatures, damping, coefficients, trust-region scale, complement
curvature, number of directions) and counters of steps without a direction or with
small eigenvalues, each warned about once per group.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.group_result import AveragedFactor, GroupStep
from dampednewton._step.guard import STACKLEVEL_OF_CALLER

GLOBAL = "global"
"""The records' entry of step counters and refresh triggers (``optimizer.records``)."""
GROUPS = "groups"
"""The records' entry of per-group statistics."""
REFRESH_DUE = "refresh_due"
"""Global state: the next step refreshes every averaged group (the loss rose)."""
REFRESH_LOSS = "refresh_loss"
"""Global state: the mini-batch loss of the last refresh."""
FIRST_REFRESH = "first_refresh_step"
"""Group statistics: the step of the group's first curvature refresh, where its
refresh schedule starts (a group added later ramps up as the first ones did; absent:
step 0, as for groups of earlier versions' checkpoints)."""
BASIS = "curvature_basis"
FROZEN = "frozen_basis"
"""A group's frozen step coefficients (:mod:`dampednewton.math.frozen_basis`)."""


def refreshes_at(averaging: Any, stats: Mapping[str, Any], step: int) -> bool:
    """Whether a group's averaging refreshes its curvature at ``step``.

    Args:
        averaging: The group's :class:`~dampednewton.CurvatureAveraging`.
        stats: The group's statistics (its refreshes so far and its first).
        step: The optimizer's step index.

    Returns:
        The schedule's answer, counted from the group's first refresh.
    """
    updates = stats.get("curvature_updates", 0)
    return averaging.refreshes(step - stats.get(FIRST_REFRESH, 0), updates)


def note_first_refresh(stats: dict[str, Any], step: int) -> None:
    """Record ``step`` as the group's first refresh if it was (one refresh so far).

    Args:
        stats: The group's statistics, after the refresh was committed.
        step: The refresh's step index.
    """
    if stats.get("curvature_updates", 0) == 1:
        stats[FIRST_REFRESH] = step


def stored_factor(
    state: Mapping[Any, dict[str, Any]], stats: dict[str, Any], group: dict[str, Any]
) -> AveragedFactor | None:
    """A group's averaged factor from the optimizer state (``None`` before any).

    Args:
        state: The optimizer's state (per parameter: the basis ``B``'s columns).
        stats: The group's statistics (its weights and number of updates).
        group: The param group.

    Returns:
        The factor, or ``None``.
    """
    updates = stats.get("curvature_updates", 0)
    if updates == 0:
        return None
    basis = tuple(state[p][BASIS] for p in group["params"])
    return AveragedFactor(basis, stats["curvature_weights"], updates)


def store_factor(
    state: Mapping[Any, dict[str, Any]],
    stats: dict[str, Any],
    params: Sequence[Tensor],
    factor: AveragedFactor,
) -> None:
    """Commit a group's updated averaged factor to the optimizer state.

    Args:
        state: The optimizer's state.
        stats: The group's statistics (updated in place).
        params: The group's parameters.
        factor: The factor of the accepted step.
    """
    for param, basis in zip(params, factor.basis, strict=True):
        state[param][BASIS] = basis
    stats.update(curvature_weights=factor.weights, curvature_updates=factor.updates)


def store_factors(
    state: Mapping[Any, dict[str, Any]],
    group_stats: Sequence[dict[str, Any]],
    param_groups: Sequence[dict[str, Any]],
    steps: Sequence[GroupStep | None],
    step_index: int,
) -> None:
    """Commit the updated averaged factor of every group whose step carries one.

    Args:
        state: The optimizer's state.
        group_stats: Per group, its statistics (updated in place).
        param_groups: The param groups.
        steps: Per group, its accepted step (or ``None``).
        step_index: The step's index (a group's first refresh is recorded).
    """
    for stats, group, step in zip(group_stats, param_groups, steps, strict=True):
        if step is not None and step.factor is not None:
            store_factor(state, stats, group["params"], step.factor)
            note_first_refresh(stats, step_index)
            if step.frozen is not None:
                stats[FROZEN] = step.frozen.as_dict()


def check_basis_unchanged(
    group_stats: Sequence[dict[str, Any]], kronecker: bool
) -> None:
    """Refuse a group whose basis changed since its last step.

    The two bases keep different curvature in the state: a group stepped with one
    cannot continue with the other.

    Args:
        group_stats: Every group's statistics.
        kronecker: Whether the groups now have the Kronecker basis.

    Raises:
        ValueError: For a group whose statistics are the other basis'.
    """
    other, name = (
        ("curvature_weights", "GramBasis")
        if kronecker
        else (
            "kronecker_layers",
            "KroneckerBasis",
        )
    )
    for index, stats in enumerate(group_stats):
        if other in stats:
            raise ValueError(
                f"Parameter group {index} was stepped with {name}: a group's basis "
                "cannot change during training, the two keep different curvature. "
                "Create a new DampedNewton with the other basis (its curvature and "
                "momentum start afresh)."
            )


def empty_group_stats() -> dict[str, Any]:
    """The statistics of a group that has not stepped yet.

    ``num_directions``: the directions the last step took with their own curvature
    (the Gram basis' selected eigenvectors; the Kronecker basis' kept pairs
    ``u_i ⊗ v_j`` summed over its layers).

    Returns:
        A fresh dict with zero counters.
    """
    return {"num_directions": 0, "steps_without_direction": 0}


def newton_record(index: int, stats: dict[str, Any]) -> dict[str, Any]:
    """A group's step quantities as entries of a diagnostics record.

    Args:
        index: The group's index.
        stats: The group's statistics after the step.

    Returns:
        ``newton/<quantity>/group<index>`` entries.
    """
    evals, damping = stats["evals"], stats["damping"]
    return {
        f"newton/num_directions/group{index}": stats["num_directions"],
        # The record goes to the host anyway (one read more, at monitored steps).
        f"newton/trust_region_scale/group{index}": float(stats["trust_region_scale"]),
        f"newton/evals/group{index}": evals.cpu().numpy(),
        f"newton/damping/group{index}": damping.cpu().numpy(),
        f"newton/max_eval/group{index}": evals.max().item() if evals.numel() else 0.0,
        f"newton/mean_damping/group{index}": (
            damping.mean().item() if damping.numel() else 0.0
        ),
    }


class StepRecorder:
    """Writes each step's per-group statistics; warns once per group.

    Call :meth:`record` from ``Pipeline._full_step`` so that the warnings point at
    the user's call.
    """

    def __init__(self) -> None:
        """Start without warnings given."""
        self._warned_no_direction: set[int] = set()
        self._warned_small_eigenvalues: set[int] = set()

    def record(
        self,
        stats: list[dict[str, Any]],
        thresholds: Sequence[float],
        small_counts: Sequence[int],
        results: Sequence[GroupStep | None],
        scales: Sequence[Tensor | float],
        record: dict | None = None,
    ) -> None:
        """Store the groups' step quantities (and add them to a diagnostics record).

        Args:
            stats: Per group, its statistics (updated in place).
            thresholds: Per group, its ``warn_small_eigvals``.
            small_counts: Per group, its selected eigenvalues below the threshold
                (read with the step's checks; ``0`` for averaged steps).
            results: Per group, its settled step (``None``: no step).
            scales: Per group, the trust-region scale ``ν`` applied.
            record: The step's diagnostics record, if any (updated in place).
        """
        for index, (result, scale) in enumerate(zip(results, scales, strict=True)):
            if result is None:
                continue
            num_directions = result.evals.numel()
            stats[index].update(
                trust_region_scale=torch.as_tensor(
                    scale, dtype=result.evals.dtype, device=result.evals.device
                ).detach(),
                complement_curvature=result.complement_curvature,
                num_directions=num_directions,
                evals=result.evals.detach(),
                gamma_mean=result.gamma_mean.detach(),
                lambda_mean=result.lambda_mean.detach(),
                damping=result.damping.detach(),
                coefficients=result.coefficients.detach(),
            )
            if record is not None:
                record.update(newton_record(index, stats[index]))
            if small_counts[index]:
                self._count_small_eigenvalues(
                    index,
                    result.evals,
                    stats[index],
                    thresholds[index],
                    small_counts[index],
                )
            if num_directions == 0:
                stats[index]["steps_without_direction"] += 1
                if index not in self._warned_no_direction:
                    self._warned_no_direction.add(index)
                    warnings.warn(
                        f"The criterion of parameter group {index} selected no "
                        "direction: the group moves by its complement step only "
                        "(not at all with the default SmallestCurvature; counted in "
                        "optimizer.records['groups'][i]['steps_without_direction']).",
                        stacklevel=STACKLEVEL_OF_CALLER + 1,  # Pipeline._full_step
                    )

    def _count_small_eigenvalues(
        self,
        index: int,
        evals: Tensor,
        stats: dict[str, Any],
        threshold: float,
        small: int,
    ) -> None:
        """Count a step along ``small`` eigenvalues below the threshold; warn once."""
        stats["steps_with_small_eigenvalues"] = (
            stats.get("steps_with_small_eigenvalues", 0) + 1
        )
        if index in self._warned_small_eigenvalues:
            return
        self._warned_small_eigenvalues.add(index)
        warnings.warn(
            f"{small} of the {evals.numel()} GGN eigenvalues selected in parameter "
            f"group {index} are below warn_small_eigvals={threshold} (smallest "
            f"{evals.abs().min().item():.2g}): directions divide by √λ and may be "
            "inaccurate. Select fewer directions (a smaller criterion=k, or "
            "EigenvalueThreshold) or set warn_small_eigvals=0 to silence this. "
            "Warned once per group; the steps are counted in "
            f"optimizer.records['groups'][{index}]['steps_with_small_eigenvalues'].",
            stacklevel=STACKLEVEL_OF_CALLER + 2,  # record, Pipeline._full_step
        )


def group_stats(
    records: dict[str, Any], groups: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``records['groups']``, created for ``groups`` the first time."""
    return records.setdefault(GROUPS, [empty_group_stats() for _ in groups])
