"""Damping policies: how much each selected GGN direction is damped.

A damping policy is a callable ``(evals, gram_evecs, gammas, lambdas) -> δ`` (ViViT's
convention, the :class:`Damping` protocol) returning one damping ``δ_k ∈ [0, ∞]`` per
selected direction; ``∞`` drops the direction (its step coefficient is zero).
``gammas`` are the per-sample slopes ``γ_nk`` (``[N_grad, K]``) and ``lambdas`` the
per-sample curvatures ``λ_nk`` (``[N_ggn, K]``) along the selected GGN eigenvectors.

Policies that read the mean slopes and curvatures only derive from
:class:`MeanStatisticsDamping`; then :class:`~dampednewton.DampedNewton` skips
individual gradients (``gammas`` is the ``[1, K]`` mean) and allows curvature
averaging. Any other callable gets per-sample slopes.

Adaptive policies (the :class:`AdaptiveDamping` protocol, e.g.
:class:`LevenbergMarquardt`) additionally define ``ratio_needed()`` and
``update(reduction_ratio)``; :class:`~dampednewton.DampedNewton` calls them once per
policy object after each step and keeps the policy (with its state) in the param
group, hence in ``state_dict``.

Adding a rule: a frozen dataclass here (deriving from :class:`MeanStatisticsDamping`
if it needs no per-sample statistics), listed in ``add_safe_globals`` at the bottom;
an adaptive one, whose state changes, checks its fields when they are set.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from dampednewton.policies.checks import check_integer, check_number


@runtime_checkable
class Damping(Protocol):
    """Maps the selected directions' statistics to one damping ``δ_k`` each."""

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return ``δ`` ``[K]`` from the directions' statistics.

        Args:
            evals: Selected eigenvalues ``[K]``.
            gram_evecs: Their Gram-space eigenvectors ``[C·N, K]``.
            gammas: Per-sample slopes ``[N_grad, K]``.
            lambdas: Per-sample curvatures ``[N_ggn, K]``.
        """


@runtime_checkable
class AdaptiveDamping(Damping, Protocol):
    """A damping policy adapted after each step by the loss's reduction ratio."""

    def ratio_needed(self) -> bool:
        """Whether the next :meth:`update` uses the reduction ratio."""

    def update(self, reduction_ratio: float) -> None:
        """Adapt to the reduction ratio ``ρ`` of the last step (NaN: unknown)."""


class MeanStatisticsDamping(ABC):
    """Base of policies that read only the mean slopes and curvatures.

    Such a policy gets ``gammas = γ̄[None]`` (no individual gradients are computed
    for it) and may be used with curvature averaging.
    """

    @abstractmethod
    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return ``δ`` ``[K]``; ``gammas``, ``lambdas`` may be the ``[1, K]`` means."""


def needs_sample_statistics(policy: Damping) -> bool:
    """Whether a policy needs per-sample slopes and curvatures (not just the means).

    Args:
        policy: A damping policy (after :func:`as_damping`).

    Returns:
        ``False`` for :class:`MeanStatisticsDamping` policies, ``True`` otherwise.
    """
    return not isinstance(policy, MeanStatisticsDamping)


@dataclass(frozen=True)
class ConstantDamping(MeanStatisticsDamping):
    """The same damping ``δ_k = value`` for every direction.

    Attributes:
        value: Non-negative damping.
    """

    value: float

    def __post_init__(self) -> None:
        """Validate the value."""
        check_number("The damping", self.value)
        if not math.isfinite(self.value) or self.value < 0:
            raise ValueError(
                f"Damping must be finite and >= 0, got {self.value!r}. Use 0 for an "
                "undamped Newton step along the selected directions."
            )

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return ``value`` for every direction."""
        return torch.full_like(evals, self.value)


@dataclass(frozen=True)
class RelativeDamping(MeanStatisticsDamping):
    """Damping relative to the curvature scale: ``δ_k = fraction · max_j λ_j``.

    The selected eigenvalues scale with the loss and the model (inputs, width), so a
    fraction of the largest transfers between problems where a constant does not.

    Attributes:
        fraction: Non-negative factor of the largest selected eigenvalue.
    """

    fraction: float

    def __post_init__(self) -> None:
        """Validate the fraction."""
        check_number("RelativeDamping's fraction", self.fraction)
        if not math.isfinite(self.fraction) or self.fraction < 0:
            raise ValueError(
                f"RelativeDamping needs a finite fraction >= 0, got {self.fraction!r}."
            )

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return ``fraction · max(evals)`` for every direction."""
        if evals.numel() == 0:
            return evals.clone()
        return (self.fraction * evals.max()).expand_as(evals).clone()


def _standard_error(samples: Tensor) -> Tensor:
    """Standard error of the mean of each column (0 for a single sample)."""
    if samples.shape[0] < 2:
        return torch.zeros(
            samples.shape[1:], dtype=samples.dtype, device=samples.device
        )
    return samples.std(dim=0) / math.sqrt(samples.shape[0])


@dataclass(frozen=True)
class NoiseAwareDamping:
    r"""Damp directions whose slope or curvature is not distinguishable from noise.

    With standard errors ``σ_γ,k`` and ``σ_λ,k`` of the mean slope ``γ̄_k`` and mean
    curvature ``λ̄_k`` (from the per-sample ``γ_nk``, ``λ_nk``), the step length along
    ``e_k`` is chosen for a pessimistic quadratic model whose slope is shrunk and
    whose curvature is inflated by ``z`` standard errors:

    .. math::

        c_k = -\frac{\operatorname{sign}(\bar\gamma_k)
              \max(|\bar\gamma_k| - z\sigma_{\gamma,k}, 0)}
             {\bar\lambda_k + z\sigma_{\lambda,k} + \delta_0},

    expressed as the damping ``δ_k`` with ``c_k = −γ̄_k/(λ̄_k + δ_k)``. A direction
    whose slope is within ``z`` standard errors of zero is dropped (``δ_k = ∞``).
    Without
    noise (identical samples) ``δ_k = δ₀``: constant damping.

    Attributes:
        base: ``δ₀ >= 0``, the damping without noise.
        z: Number of standard errors (``>= 0``); 0 gives constant damping ``δ₀``.
    """

    base: float = 1e-4
    z: float = 1.0

    def __post_init__(self) -> None:
        """Validate the settings."""
        ConstantDamping(self.base)
        check_number("z", self.z)
        if not math.isfinite(self.z) or self.z < 0:
            raise ValueError(f"z must be finite and >= 0, got {self.z!r}.")

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return ``δ_k`` from the per-sample slopes and curvatures."""
        gamma_mean, lambda_mean = gammas.mean(0), lambdas.mean(0)
        slope = (gamma_mean.abs() - self.z * _standard_error(gammas)).clamp(min=0)
        curvature = lambda_mean + self.z * _standard_error(lambdas) + self.base
        # c = −γ̄/(λ̄+δ) = −sign(γ̄)·slope/curvature  ⇒  δ = |γ̄|·curvature/slope − λ̄
        damping = gamma_mean.abs() * curvature / slope - lambda_mean
        damping = torch.where(slope > 0, damping.clamp(min=0), torch.inf)
        return torch.where(
            gamma_mean == 0, torch.full_like(damping, self.base), damping
        )


@dataclass(frozen=True)
class GSNRDamping:
    r"""Damping from the directional gradient signal-to-noise ratio (McCandlish et al.).

    Along a GGN eigenvector ``e_k`` with curvature ``λ̄_k``, per-sample slope variance
    ``Σ_k = Var_n(γ_nk)`` and batch size ``B``, the noise-optimal step of
    McCandlish et al. (2018) is the Newton step shrunk by ``1/(1 + B_noise,k/B)`` with
    the noise scale ``B_noise,k = Σ_k/|G_k|²``, i.e. an LM damping

    .. math:: \delta_k = \delta_0 + \bar\lambda_k \frac{\Sigma_k}{B\,|G_k|^2}.

    ``|G_k|²`` is estimated without bias by ``γ̄_k² − Σ_k/B`` (the plain ``γ̄_k²``
    carries the noise floor ``Σ_k/B``, so the plain GSNR of pure noise is about
    ``1/(B−1)``, not 0). Directions whose debiased signal is not positive are dropped
    (``δ_k = ∞``). Without noise ``δ_k = δ₀``.

    Attributes:
        base: ``δ₀ >= 0``, the damping without noise.
    """

    base: float = 1e-4

    def __post_init__(self) -> None:
        """Validate the settings."""
        ConstantDamping(self.base)

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return ``δ_k`` from the directional GSNR."""
        batch_size = gammas.shape[0]
        gamma_mean, lambda_mean = gammas.mean(0), lambdas.mean(0)
        variance = gammas.var(dim=0) if batch_size > 1 else torch.zeros_like(gamma_mean)
        signal = gamma_mean**2 - variance / batch_size
        damping = self.base + lambda_mean * variance / (batch_size * signal)
        damping = torch.where(signal > 0, damping, torch.inf)
        return torch.where(variance == 0, torch.full_like(damping, self.base), damping)


@dataclass
class LevenbergMarquardt(MeanStatisticsDamping):
    """Levenberg-Marquardt damping adapted by the reduction ratio (K-FAC's rule).

    After each step, :class:`~dampednewton.DampedNewton` evaluates the loss again on
    the same batch and passes ``ρ = (L(θ + s) − L(θ)) / q(s)`` to :meth:`update`,
    where ``q(s) = ḡᵀs + ½ sᵀGs`` is the quadratic model of the step taken (summed over
    all groups; along the directions ``Σ_k (γ̄_k c_k + ½ λ̄_k c_k²)``, plus the
    complement step's terms, see :mod:`dampednewton._step.quadratic_model`). Every
    ``interval`` updates, ``δ`` is multiplied by ``increase`` when ``ρ < 1/4`` (the
    model was too optimistic) and by ``decrease`` when ``ρ > 3/4``, then clipped to
    ``[minimum, maximum]``. The optimizer updates it on the steps that refresh the
    curvature (every step without averaging; with the Gram basis' default
    averaging, at steps 0, 1, 3, 7, 15, 31, ... so ``interval=5`` adapts on every
    fifth refresh): between refreshes the step follows a frozen basis, and an
    adaptation there would change the trajectory with the refresh schedule.

    Attributes:
        value: Current damping ``δ`` (the state).
        decrease: Factor in ``(0, 1)`` applied when ``ρ > 3/4``.
        increase: Factor ``> 1`` applied when ``ρ < 1/4``.
        minimum: Lower bound for ``δ``.
        maximum: Upper bound for ``δ``.
        interval: Adapt every ``interval`` updates (the state ``updates`` counts).
        updates: Number of :meth:`update` calls so far (state).
    """

    value: float = 1.0
    decrease: float = 2 / 3
    increase: float = 3 / 2
    minimum: float = 1e-8
    maximum: float = 1e8
    interval: int = 1
    updates: int = 0

    def __post_init__(self) -> None:
        """Validate the settings."""
        _check_levenberg_marquardt(vars(self))

    def __setattr__(self, name: str, value: object) -> None:
        """Set a field, checked with the others as at construction.

        The optimizer trusts the settings without checking them at each step, so an
        invalid one must not get in by assignment either.

        Raises:
            TypeError: For a field of the wrong type.
            ValueError: For a field out of its range.
        """
        if _LM_FIELDS <= vars(self).keys():  # constructed: __post_init__ checked
            _check_levenberg_marquardt({**vars(self), name: value})
        super().__setattr__(name, value)

    def __call__(
        self, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
    ) -> Tensor:
        """Return the current ``δ`` for every direction."""
        return torch.full_like(evals, self.value)

    def ratio_needed(self) -> bool:
        """Whether the next :meth:`update` adapts ``δ`` (and so needs ``ρ``)."""
        return (self.updates + 1) % self.interval == 0

    def update(self, reduction_ratio: float) -> None:
        """Adapt ``δ`` to the reduction ratio ``ρ`` of the last step.

        Args:
            reduction_ratio: Actual over predicted loss change; NaN (no predicted
                change) leaves ``δ`` unchanged.
        """
        self.updates += 1
        if self.updates % self.interval or math.isnan(reduction_ratio):
            return
        value = self.value
        if reduction_ratio < 0.25:
            value *= self.increase
        elif reduction_ratio > 0.75:
            value *= self.decrease
        self.value = min(max(value, self.minimum), self.maximum)


_LM_FIELDS = {
    "value",
    "decrease",
    "increase",
    "minimum",
    "maximum",
    "interval",
    "updates",
}


def _check_levenberg_marquardt(fields: dict[str, Any]) -> None:
    """Check :class:`LevenbergMarquardt`'s fields together.

    Raises:
        TypeError: For a field of the wrong type.
        ValueError: For a field out of its range.
    """
    for name in ("value", "decrease", "increase", "minimum", "maximum"):
        check_number(f"LevenbergMarquardt's {name}", fields[name])
    check_integer("LevenbergMarquardt's interval", fields["interval"], 1)
    check_integer("LevenbergMarquardt's updates", fields["updates"], 0)
    ConstantDamping(fields["value"])
    decrease, increase = fields["decrease"], fields["increase"]
    if not 0 < decrease < 1 or not increase > 1:
        raise ValueError(
            "LevenbergMarquardt needs 0 < decrease < 1 < increase, got "
            f"decrease={decrease}, increase={increase}."
        )
    if not 0 <= fields["minimum"] <= fields["value"] <= fields["maximum"]:
        raise ValueError(
            "LevenbergMarquardt needs 0 <= minimum <= value <= maximum, got "
            f"{fields['minimum']}, {fields['value']}, {fields['maximum']}."
        )


def as_damping(damping: float | Damping) -> Damping:
    """Turn the shorthand ``float`` into :class:`ConstantDamping`; pass callables.

    Args:
        damping: A non-negative number or a callable damping policy.

    Returns:
        A callable damping policy.

    Raises:
        ValueError: For a negative or non-finite number.
        TypeError: For anything that is neither a number nor callable.
    """
    if isinstance(damping, int | float) and not isinstance(damping, bool):
        return ConstantDamping(float(damping))
    if isinstance(damping, Damping):
        return damping
    raise TypeError(
        "damping must be a number >= 0 or a callable (evals, gram_evecs, gammas, "
        f"lambdas) -> δ, got {type(damping).__name__}."
    )


# Policies live in param groups: let `torch.load(weights_only=True)` restore them.
torch.serialization.add_safe_globals(
    [
        ConstantDamping,
        RelativeDamping,
        NoiseAwareDamping,
        GSNRDamping,
        LevenbergMarquardt,
    ]
)
