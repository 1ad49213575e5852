r"""The complement step: curvature policies and its pure tensor math.

ViViT's step moves only inside the span of the selected GGN eigenvectors ``e_k`` and
throws away the part of the mean gradient ``ḡ`` outside it. The complement step also
moves along that part, treating the GGN there as the constant curvature ``ρ`` (the
damped inverse of the low-rank GGN, as in Nyström PCG and SketchySGD):

.. math::

    s = \sum_k \frac{-\bar\gamma_k}{\bar\lambda_k + \delta_k} e_k
        - \frac{1}{\rho}\Big(\bar g - \sum_k (\bar g^\top e_k) e_k\Big).

With ``p_k = ḡᵀe_k`` the step is ``Σ_k (c_k + p_k/ρ) e_k − ḡ/ρ``: one map of the
directions plus a multiple of the gradient. ``ρ`` comes from a policy:
:class:`SmallestCurvature` (the smallest kept ``λ̄_k + δ_k``, so that the complement is
never stepped along more boldly than the flattest kept direction),
:class:`MeasuredCurvature` (that, or the batch GGN's curvature along the complement
``g_⊥ = ḡ − Σ_k p_k e_k`` if larger) or :class:`ConstantCurvature`; ``None`` switches
the complement off (ViViT's step).

The low-rank model assumes the GGN is flatter outside the kept directions than along
the flattest kept one. With few directions, or directions averaged over past batches,
that fails: ``g_⊥`` can have more curvature under this batch's GGN ``Ĝ = VVᵀ`` than
``λ̄_min``, and ``−g_⊥/(λ̄_min + δ)`` overshoots. The Rayleigh quotient
``q_⊥ = g_⊥ᵀĜg_⊥ / ‖g_⊥‖² = ‖Vᵀg_⊥‖² / ‖g_⊥‖²`` costs one contraction with ``V`` that
the step computes anyway, and ``ρ = max(λ̄_j, q_⊥) + δ_j`` (``j`` the flattest kept
direction) makes the complement step the damped Newton step along ``g_⊥`` itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class ComplementPolicy(Protocol):
    """Maps the kept directions' curvatures and dampings to ``ρ`` (or ``None``).

    ``measured`` is ``q_⊥``, the batch GGN's curvature along the gradient's part
    outside the directions, where the step has this batch's GGN (``None`` on steps
    that reuse an averaged factor).
    """

    def __call__(
        self, lambda_mean: Tensor, damping: Tensor, measured: Tensor | None = None
    ) -> Tensor | None:
        """Return ``ρ > 0`` as a scalar tensor, or ``None`` for no complement step.

        Without a kept direction the built-in policies return ``inf`` (a step
        ``−g_⊥/ρ = 0``), which, unlike ``None``, needs no host sync to decide.
        """


@dataclass(frozen=True)
class SmallestCurvature:
    """``ρ = min_k (λ̄_k + δ_k)`` over the kept directions (those with finite ``δ_k``).

    Without a kept direction there is no curvature to borrow: ``ρ = inf``, no
    complement step.
    """

    def __call__(
        self, lambda_mean: Tensor, damping: Tensor, measured: Tensor | None = None
    ) -> Tensor | None:
        """Return the smallest damped curvature, ``inf`` without kept directions."""
        damped = lambda_mean + damping
        kept = torch.where(torch.isfinite(damped), damped, torch.inf)
        return torch.cat([kept, kept.new_full((1,), torch.inf)]).min()


@dataclass(frozen=True)
class MeasuredCurvature:
    """``ρ = max(λ̄_j, q_⊥) + δ_j``, ``j = argmin_k (λ̄_k + δ_k)`` over kept directions.

    ``q_⊥`` is this batch's GGN curvature along the gradient's complement (see the
    module docstring). Where it is not measured (steps that reuse an averaged factor)
    this is :class:`SmallestCurvature`. Without a kept direction ``ρ = inf``: no
    complement step.
    """

    def __call__(
        self, lambda_mean: Tensor, damping: Tensor, measured: Tensor | None = None
    ) -> Tensor | None:
        """Return ``ρ``, ``inf`` without kept directions."""
        if lambda_mean.numel() == 0:
            return lambda_mean.new_full((), torch.inf)
        damped = lambda_mean + damping
        flattest = torch.where(torch.isfinite(damped), damped, torch.inf).argmin()
        curvature = lambda_mean[flattest]
        if measured is not None:
            curvature = torch.maximum(curvature, measured.to(curvature))
        # Without a kept direction every damping is infinite, and so is ρ.
        return curvature + damping[flattest]


@dataclass(frozen=True)
class ConstantCurvature:
    """A fixed curvature ``ρ > 0`` for the complement.

    Attributes:
        value: The curvature ``ρ`` (the complement step is ``−g_⊥/ρ``).
    """

    value: float

    def __post_init__(self) -> None:
        """Validate ``value``."""
        if isinstance(self.value, bool) or not isinstance(self.value, int | float):
            raise TypeError(
                f"The complement curvature must be a finite number > 0, got "
                f"{self.value!r} (use complement=None to switch the complement off)."
            )
        if not math.isfinite(self.value) or self.value <= 0:
            raise ValueError(
                f"The complement curvature must be a finite number > 0, got "
                f"{self.value!r} (use complement=None to switch the complement off)."
            )

    def __call__(
        self, lambda_mean: Tensor, damping: Tensor, measured: Tensor | None = None
    ) -> Tensor:
        """Return ``ρ`` as a tensor."""
        return lambda_mean.new_full((), float(self.value))


def as_complement(
    complement: float | ComplementPolicy | None,
) -> ComplementPolicy | None:
    """Turn the shorthand ``float`` into :class:`ConstantCurvature`; pass policies.

    Args:
        complement: ``None`` (off), a number ``ρ > 0``, or a policy.

    Returns:
        The policy, or ``None``.

    Raises:
        ValueError: For a number that is not finite and positive.
        TypeError: For anything else that is not callable.
    """
    if complement is None:
        return None
    if isinstance(complement, int | float) and not isinstance(complement, bool):
        return ConstantCurvature(float(complement))
    if isinstance(complement, ComplementPolicy):
        return complement
    raise TypeError(
        "complement must be None, a number > 0 or a policy such as "
        f"SmallestCurvature(), got {type(complement).__name__}."
    )


# Policies live in param groups: let `torch.load(weights_only=True)` restore them.
torch.serialization.add_safe_globals(
    [SmallestCurvature, MeasuredCurvature, ConstantCurvature]
)
