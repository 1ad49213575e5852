"""Gradient noise: GSNR and the gradient noise scale, from ``sum_grad_squared``.

Formulas in :mod:`dampednewton.diagnostics.gsnr`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from backpack.extensions import SumGradSquared
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor

from dampednewton.backpack.savefields import SUM_GRAD_SQUARED
from dampednewton.diagnostics.gsnr import (
    gsnr_sums,
    per_sample_variance,
    plain_noise_scale,
    unbiased_noise_scale,
)
from dampednewton.diagnostics.ranks import SINGLE_PROCESS, Ranks, summed_over_ranks
from dampednewton.diagnostics.reducer import (
    Entries,
    NamedParams,
    detached_gradient_of,
    pieces_of,
    quantity,
)
from dampednewton.diagnostics.schedules import EveryKSteps, Schedule
from dampednewton.diagnostics.specs.checks import check_label, check_schedule


@dataclass(frozen=True)
class GSNR:
    """Gradient signal-to-noise ratio, plain and debiased (needs ``N ≥ 4``).

    Record keys: ``{label}/mean`` and ``{label}/mean_debiased`` (means over all
    parameter elements), and the same per parameter with ``/{name}``. Formulas in
    :mod:`dampednewton.diagnostics.gsnr`.

    Attributes:
        schedule: When to compute.
        epsilon: Stabilizer ``ε`` in the denominator (Cockpit uses 1e-5; choose it
            well below the typical per-sample gradient variance).
        label: Key prefix.
    """

    schedule: Schedule = field(default_factory=EveryKSteps)
    epsilon: float = 1e-8
    label: str = "gsnr"

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            ValueError: If ``epsilon < 0`` or the label is invalid.
        """
        check_schedule(self.schedule)
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon must be ≥ 0, got {self.epsilon}.")
        check_label(self.label)

    def make_reducer(self) -> GSNRReducer:
        """A fresh :class:`GSNRReducer` that computes this diagnostic."""
        return GSNRReducer(self)


@dataclass(frozen=True)
class NoiseScale:
    """Gradient noise scale ``B_simple = tr(Σ)/|G|²`` of the whole network.

    Record keys (``{label}/…``): ``b_simple``, ``trace_covariance`` and
    ``squared_gradient_norm`` from the unbiased estimates, and the same three with
    the suffix ``_plain`` from the plain ones. Formulas in
    :mod:`dampednewton.diagnostics.gsnr`.

    Attributes:
        schedule: When to compute.
        label: Key prefix.
    """

    schedule: Schedule = field(default_factory=EveryKSteps)
    label: str = "noise_scale"

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            ValueError: If the label is invalid.
        """
        check_schedule(self.schedule)
        check_label(self.label)

    def make_reducer(self) -> NoiseScaleReducer:
        """A fresh :class:`NoiseScaleReducer` that computes this diagnostic."""
        return NoiseScaleReducer(self)


SpecT = TypeVar("SpecT", GSNR, NoiseScale)


class SumGradSquaredReducer(Generic[SpecT]):
    """Keeps each parameter's ``sum_grad_squared`` (parameter-sized)."""

    def __init__(self, spec: SpecT) -> None:
        """Create the reducer.

        Args:
            spec: GSNR or noise-scale diagnostic.
        """
        self.spec: SpecT = spec
        self._ranks: Ranks = SINGLE_PROCESS
        self._pieces: dict[int, Tensor] = {}

    def extensions(self) -> list[BackpropExtension]:
        """Return ``[SumGradSquared()]``."""
        return [SumGradSquared()]

    def begin(self, ranks: Ranks) -> None:
        """Forget the previous step; this one's global batch is split over ``ranks``.

        Args:
            ranks: The ranks of the step's global batch.
        """
        self._ranks = ranks
        self._pieces = {}

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Keep a reference to ``param.sum_grad_squared``.

        Args:
            param: Parameter whose module's backward just ran.
            batch_size: Number of samples (unused).
        """
        value = quantity(param, SUM_GRAD_SQUARED)
        if value is not None:
            self._pieces[id(param)] = value

    def variances(self, named_params: NamedParams, batch_size: int) -> list[Tensor]:
        """Per-sample variances ``V`` of the named parameters' gradients.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples ``N`` of the global batch.

        Returns:
            One variance tensor per parameter.
        """
        local = [
            pieces_of(self._pieces, name, param, SUM_GRAD_SQUARED)
            for name, param in named_params
        ]
        # Each rank's Σ_n (g_n/N)² has its local N = N_global/R: rescale by 1/R².
        rescale = self._ranks.world_size**2
        return [
            per_sample_variance(
                detached_gradient_of(param), total / rescale, batch_size
            )
            for (_, param), total in zip(
                named_params, summed_over_ranks(local, self._ranks), strict=True
            )
        ]


class GSNRReducer(SumGradSquaredReducer[GSNR]):
    """Plain and debiased GSNR means, per parameter and over the network."""

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Mean GSNR and debiased GSNR per parameter and over all elements.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples ``N``.

        Returns:
            Record entries (0-dim tensors).
        """
        label, epsilon = self.spec.label, self.spec.epsilon
        entries: Entries = {}
        plain_sum, debiased_sum, count = [], [], 0
        variances = self.variances(named_params, batch_size)
        for (name, param), variance in zip(named_params, variances, strict=True):
            grad = detached_gradient_of(param)
            plain, debiased = gsnr_sums(grad, variance, batch_size, epsilon)
            entries[f"{label}/mean/{name}"] = plain / grad.numel()
            entries[f"{label}/mean_debiased/{name}"] = debiased / grad.numel()
            plain_sum.append(plain)
            debiased_sum.append(debiased)
            count += grad.numel()
        entries[f"{label}/mean"] = torch.stack(plain_sum).sum() / count
        entries[f"{label}/mean_debiased"] = torch.stack(debiased_sum).sum() / count
        return entries


class NoiseScaleReducer(SumGradSquaredReducer[NoiseScale]):
    """Network-wide gradient noise scale, unbiased and plain."""

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Noise scale and its parts from all named parameters together.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples ``N``.

        Returns:
            Record entries (0-dim tensors).
        """
        variances = self.variances(named_params, batch_size)
        variance_sum = torch.stack([v.sum() for v in variances]).sum()
        norm = torch.stack(
            [(detached_gradient_of(p) ** 2).sum() for _, p in named_params]
        )
        norm = norm.sum()
        label = self.spec.label
        entries: Entries = {}
        for suffix, estimate in (
            ("", unbiased_noise_scale(norm, variance_sum, batch_size)),
            ("_plain", plain_noise_scale(norm, variance_sum)),
        ):
            entries[f"{label}/b_simple{suffix}"] = estimate.noise_scale
            entries[f"{label}/trace_covariance{suffix}"] = estimate.trace_covariance
            entries[f"{label}/squared_gradient_norm{suffix}"] = (
                estimate.squared_gradient_norm
            )
        return entries
