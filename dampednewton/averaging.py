"""Curvature averaged across steps: the policy (:class:`CurvatureAveraging`).

The averaged GGN is kept as a rank-``r`` factor ``B Bᵀ`` and updated with each
refreshing batch's square root; the update's math is
:mod:`dampednewton.math.averaged_gram`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dampednewton.policies.criteria import Criterion, TopK

DEFAULT_RANK = 20
"""Rank of the averaged factor for criteria other than top-k."""


@dataclass(frozen=True)
class CurvatureAveraging:
    """Average the GGN across steps as a rank-``rank`` factor.

    Attributes:
        decay: ``β`` in ``[0, 1)``: the weight of the past at each refresh (``0``:
            the refreshing batch only).
        rank: Columns ``r`` of the factor ``B`` (the criterion then picks among its
            ``r`` eigen-directions); ``None``: the ``k`` of a :class:`TopK` criterion,
            else 20.
        interval: Refresh the factor every ``interval`` steps. The steps in
            between keep its basis, damping and complement curvature and take the
            step along it with the new mean gradient only
            (:mod:`dampednewton.math.frozen_basis`), after a backward pass with
            BackPACK's hooks suspended: about the cost of an Adam step.
        ramp: Start with frequent refreshes while the curvature changes fast: the
            gaps between refreshes double from 1 (steps 0, 1, 3, 7, …) until they
            reach ``interval``.
        loss_tolerance: Refresh at the next step when a step between refreshes
            sees a mini-batch loss above ``1 + loss_tolerance`` times the loss of
            the last refresh (the frozen curvature no longer describes the model);
            ``None`` only follows the schedule.
    """

    decay: float = 0.6
    rank: int | None = None
    interval: int = 20
    ramp: bool = True
    loss_tolerance: float | None = 1.0

    def __post_init__(self) -> None:
        """Validate the settings."""
        if (
            isinstance(self.decay, bool)
            or not isinstance(self.decay, int | float)
            or not 0 <= self.decay < 1
        ):
            raise ValueError(
                f"CurvatureAveraging needs 0 <= decay < 1, got {self.decay!r}."
            )
        tolerance = self.loss_tolerance
        if tolerance is not None and (
            isinstance(tolerance, bool)
            or not isinstance(tolerance, int | float)
            or not tolerance >= 0
        ):
            raise ValueError(
                "CurvatureAveraging needs loss_tolerance >= 0 or None, got "
                f"{tolerance!r}."
            )
        if not isinstance(self.ramp, bool):
            raise TypeError(f"CurvatureAveraging needs a bool ramp, got {self.ramp!r}.")
        for name in ("rank", "interval"):
            value = getattr(self, name)
            if name == "rank" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"CurvatureAveraging needs an integer {name} >= 1, got {value!r}."
                )
            if value < 1:
                raise ValueError(
                    f"CurvatureAveraging needs an integer {name} >= 1, got {value!r}."
                )

    def rank_for(self, criterion: Criterion) -> int:
        """The factor's rank: ``rank``, or the ``k`` of a top-``k`` criterion.

        Args:
            criterion: The group's criterion.

        Returns:
            The number of columns to keep.
        """
        if self.rank is not None:
            return self.rank
        return criterion.k if isinstance(criterion, TopK) else DEFAULT_RANK

    def refreshes(self, step: int, updates: int) -> bool:
        """Whether step ``step`` (from 0) refreshes a factor of ``updates`` batches.

        Args:
            step: The optimizer's step index.
            updates: Batches averaged into the factor so far.

        Returns:
            ``True`` for the first factor and on the schedule's refresh steps.
        """
        if updates == 0:
            return True
        if not self.ramp:
            return step % self.interval == 0
        # Gaps 1, 2, 4, … below the interval end at step 2^m − 1, the first with
        # 2^m ≥ interval; from there every interval steps.
        end_of_ramp = (1 << (self.interval - 1).bit_length()) - 1
        if step <= end_of_ramp:
            return (step + 1) & step == 0
        return (step - end_of_ramp) % self.interval == 0


# Policies live in param groups: let `torch.load(weights_only=True)` restore them.
torch.serialization.add_safe_globals([CurvatureAveraging])
