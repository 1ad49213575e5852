r"""The quadratic model of a step and the trust-region scale derived from it.

A group's step ``s`` (before the learning rate) is summarized by its slope ``ḡᵀs``
and its curvature ``sᵀGs`` under the GGN estimate the step was built from, so that
for a multiple ``a·s`` the model predicts ``q(a·s) = a·ḡᵀs + ½ a² sᵀGs``.

The damped model the step minimizes has the curvature ``sᵀAs = −ḡᵀs`` (with ``A``
the damped GGN, ``ρ`` on the complement). Bounding ``½ ν² sᵀAs`` by ``κ`` is K-FAC's
norm constraint (its "KL clip": for the cross-entropy the GGN is the Fisher, and the
bound limits the predicted change of the predictive distribution per step). The
bound also applies to this batch's GGN curvature ``sᵀĜs`` where it is known. It bounds
the step before the learning rate, which then scales the update ``lr·ν·s``: a
learning-rate schedule acts on every step, also where the bound is active (with
``lr = 1``, K-FAC's constraint on the update itself).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor


class StepModel(Protocol):
    """A step's quadratic model: its slope ``ḡᵀs`` and curvature ``sᵀGs``."""

    @property
    def slope(self) -> Tensor:
        """``ḡᵀs`` (0-dim)."""

    @property
    def curvature(self) -> Tensor:
        """``sᵀGs`` (0-dim)."""


def predicted_change(scale: Tensor | float, slope: Tensor, curvature: Tensor) -> Tensor:
    """``q(a·s) = a·ḡᵀs + ½ a²·sᵀGs`` for the multiple ``a`` of a step.

    Args:
        scale: ``a`` (learning rate times trust-region scale).
        slope: ``ḡᵀs``.
        curvature: ``sᵀGs``.

    Returns:
        The predicted loss change (negative for a descent step).
    """
    return scale * slope + 0.5 * scale**2 * curvature


def trust_region_scale(
    slope: Tensor, batch_curvature: Tensor | None, kl_clip: float | None
) -> Tensor | float:
    """Largest ``ν ≤ 1`` with ``½ ν² · max(sᵀAs, sᵀĜs) ≤ κ``.

    ``sᵀAs = −ḡᵀs`` is the damped model's own curvature along the step, ``sᵀĜs``
    that of this batch's GGN (where known): a model built from old or few directions
    can miss curvature that the current batch sees, and the bound must hold for both.

    Args:
        slope: ``ḡᵀs`` of the (descent) step.
        batch_curvature: ``sᵀĜs``, or ``None``.
        kl_clip: ``κ``; ``None`` switches the bound off.

    Returns:
        ``ν`` (a tensor, to avoid a device sync, or ``1.0``).
    """
    if kl_clip is None:
        return 1.0
    curvature = (-slope).clamp_min(0)
    if batch_curvature is not None:
        curvature = torch.maximum(curvature, batch_curvature.to(curvature))
    # ν = min(1, √(bound / curvature)); a zero curvature gives inf, hence 1. The
    # absolute value: a step of slope +0 has curvature −0 (clamp_min keeps it), whose
    # bound −inf would give a NaN scale.
    return (2 * kl_clip / curvature.abs()).sqrt().clamp_max(1.0)


def trust_region_scale_on_host(slope: float, kl_clip: float | None) -> float:
    """:func:`trust_region_scale` of a slope read to the host, without the batch's.

    Args:
        slope: ``ḡᵀs`` of the step.
        kl_clip: ``κ``; ``None`` switches the bound off.

    Returns:
        ``ν = min(1, √(2κ / (−ḡᵀs)))`` (``1`` for a step that does not descend).
    """
    if kl_clip is None or slope >= 0:
        return 1.0
    return min(1.0, math.sqrt(2 * kl_clip / -slope))
