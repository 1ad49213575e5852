"""Per-step plumbing of each diagnostic: reduce in the backward hook, assemble after.

A reducer belongs to one diagnostic spec. During backward, :meth:`reduce` turns
one parameter's BackPACK quantities into small pieces (counts, sums, references
to parameter-sized tensors) so the per-sample tensors can be freed layer by layer;
it never deletes BackPACK's attributes. After backward, :meth:`assemble` builds
the record entries (tensors, still on the device) from those pieces and
``p.grad``. Reducers hold the state of one step at a time (:meth:`begin`), plus,
for histograms, the network range carried to the next tracked step. Histograms with
Cockpit's semantics keep the individual gradients until :meth:`assemble`, which bins
them in the network range of the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from backpack.extensions import BatchGrad, SumGradSquared
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor

from dampednewton.diagnostics.bin_adaptation import range_hull
from dampednewton.diagnostics.gsnr import (
    gsnr_sums,
    per_sample_variance,
    plain_noise_scale,
    unbiased_noise_scale,
)
from dampednewton.diagnostics.histogram import OutOfRange, histogram1d, histogram2d
from dampednewton.diagnostics.specs import (
    GSNR,
    CurvatureTrace,
    Diagnostic,
    GradientHistogram,
    GradientParameterHistogram,
    NoiseScale,
)
from dampednewton.diagnostics.trace import (
    curvature_extension,
    diagonal_trace,
    total_trace,
)

NamedParams = Sequence[tuple[str, Tensor]]
Entries = dict[str, Tensor]

_OUT_OF_RANGE: dict[str, OutOfRange] = {"dampednewton": "count", "cockpit": "clamp"}
"""How each histogram semantics bins out-of-range values."""


class MissingQuantityError(RuntimeError):
    """BackPACK did not compute a quantity that a diagnostic needs."""


class Reducer(Protocol):
    """Plumbing of one diagnostic for one step at a time."""

    spec: Diagnostic

    def extensions(self) -> list[BackpropExtension]:
        """BackPACK extensions this diagnostic needs."""

    def begin(self) -> None:
        """Forget the pieces of the previous step."""

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Reduce the BackPACK quantities of ``param`` (inside the backward hook)."""

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Record entries for the parameters ``named_params`` (after backward)."""


def _quantity(param: Tensor, savefield: str) -> Tensor | None:
    value = getattr(param, savefield, None)
    return None if value is None else value.detach()


def _pieces_of(pieces: dict[int, object], name: str, param: Tensor, savefield: str):
    try:
        return pieces[id(param)]
    except KeyError:
        raise MissingQuantityError(
            f"BackPACK computed no '{savefield}' for parameter '{name}' although it "
            "has a gradient. Is its module extended with backpack.extend and "
            "supported by BackPACK's extensions?"
        ) from None


class SumGradSquaredReducer:
    """Keeps each parameter's ``sum_grad_squared`` (parameter-sized)."""

    def __init__(self, spec: GSNR | NoiseScale) -> None:
        """Create the reducer.

        Args:
            spec: GSNR or noise-scale diagnostic.
        """
        self.spec = spec
        self._pieces: dict[int, Tensor] = {}

    def extensions(self) -> list[BackpropExtension]:
        """Return ``[SumGradSquared()]``."""
        return [SumGradSquared()]

    def begin(self) -> None:
        """Forget the pieces of the previous step."""
        self._pieces = {}

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Keep a reference to ``param.sum_grad_squared``.

        Args:
            param: Parameter whose module's backward just ran.
            batch_size: Number of samples (unused).
        """
        value = _quantity(param, "sum_grad_squared")
        if value is not None:
            self._pieces[id(param)] = value

    def variances(self, named_params: NamedParams, batch_size: int) -> list[Tensor]:
        """Per-sample variances ``V`` of the named parameters' gradients.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples ``N``.

        Returns:
            One variance tensor per parameter.
        """
        return [
            per_sample_variance(
                param.grad.detach(),
                _pieces_of(self._pieces, name, param, "sum_grad_squared"),
                batch_size,
            )
            for name, param in named_params
        ]


class GSNRReducer(SumGradSquaredReducer):
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
            grad = param.grad.detach()
            plain, debiased = gsnr_sums(grad, variance, batch_size, epsilon)
            entries[f"{label}/mean/{name}"] = plain / grad.numel()
            entries[f"{label}/mean_debiased/{name}"] = debiased / grad.numel()
            plain_sum.append(plain)
            debiased_sum.append(debiased)
            count += grad.numel()
        entries[f"{label}/mean"] = torch.stack(plain_sum).sum() / count
        entries[f"{label}/mean_debiased"] = torch.stack(debiased_sum).sum() / count
        return entries


class NoiseScaleReducer(SumGradSquaredReducer):
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
        norm = torch.stack([(p.grad.detach() ** 2).sum() for _, p in named_params])
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


class _IndividualGradientReducer:
    """Base of the histogram reducers, which bin ``N·grad_batch``."""

    _pieces: dict[int, tuple]

    def extensions(self) -> list[BackpropExtension]:
        """Return ``[BatchGrad()]``."""
        return [BatchGrad()]

    def begin(self) -> None:
        """Forget the pieces of the previous step."""
        self._pieces = {}

    @staticmethod
    def _individual_gradients(param: Tensor, batch_size: int) -> Tensor | None:
        grad_batch = _quantity(param, "grad_batch")
        return None if grad_batch is None else grad_batch * batch_size


class GradientHistogramReducer(_IndividualGradientReducer):
    """1D histograms of individual gradient elements."""

    def __init__(self, spec: GradientHistogram) -> None:
        """Create the reducer.

        Args:
            spec: The histogram diagnostic.
        """
        self.spec = spec
        self.network_range = spec.initial_range
        self._pieces: dict[int, tuple] = {}

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Bin ``N·grad_batch`` with the parameter's own and the network range.

        With Cockpit's semantics the network range is only known once every layer
        was reached: the individual gradients are kept and binned in
        :meth:`assemble`.

        Args:
            param: Parameter whose module's backward just ran.
            batch_size: Number of samples ``N``.
        """
        individual = self._individual_gradients(param, batch_size)
        if individual is None:
            return
        bins, out_of_range = self.spec.bins, _OUT_OF_RANGE[self.spec.semantics]
        own_range = self.spec.range_policy.compute(individual)
        own = histogram1d(individual, *own_range, bins, out_of_range=out_of_range)
        if self.spec.semantics == "cockpit":
            network = individual.detach()
        elif own_range != self.network_range:
            network = histogram1d(individual, *self.network_range, bins)
        else:
            network = own
        self._pieces[id(param)] = (own_range, own, network)

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Per-parameter and network histograms; update the next network range.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples (unused).

        Returns:
            Record entries (tensors).
        """
        label = self.spec.label
        entries: Entries = {}
        ranges, network = [], []
        for name, param in named_params:
            own_range, own, in_network = _pieces_of(
                self._pieces, name, param, "grad_batch"
            )
            entries.update(_histogram1d_entries(label, own, f"/{name}"))
            ranges.append(own_range)
            network.append(in_network)
        self.network_range = range_hull(ranges)
        if self.spec.semantics == "cockpit":
            network = [
                histogram1d(
                    individual,
                    *self.network_range,
                    self.spec.bins,
                    out_of_range="clamp",
                )
                for individual in network
            ]
        total = _summed(network, ("counts", "below", "above", "nan"))
        entries.update(_histogram1d_entries(label, total, ""))
        return entries


def _summed(histograms: list, fields: tuple[str, ...]):
    """The network histogram: per-parameter ones in the same range, added up."""
    return histograms[0]._replace(
        **{
            field: torch.stack([getattr(h, field) for h in histograms]).sum(0)
            for field in fields
        }
    )


def _entries(label: str, histogram, suffix: str, fields: tuple[str, ...]) -> Entries:
    return {f"{label}/{field}{suffix}": getattr(histogram, field) for field in fields}


def _histogram1d_entries(label: str, histogram, suffix: str) -> Entries:
    return _entries(
        label, histogram, suffix, ("counts", "edges", "below", "above", "nan")
    )


class GradientParameterHistogramReducer(_IndividualGradientReducer):
    """2D histograms of (individual gradient element, parameter value)."""

    def __init__(self, spec: GradientParameterHistogram) -> None:
        """Create the reducer.

        Args:
            spec: The 2D histogram diagnostic.
        """
        self.spec = spec
        self.network_ranges = (
            spec.initial_gradient_range,
            spec.initial_parameter_range,
        )
        self._pieces: dict[int, tuple] = {}

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Bin the pairs (``N·grad_batch``, parameter) with own and network ranges.

        Args:
            param: Parameter whose module's backward just ran.
            batch_size: Number of samples ``N``.
        """
        individual = self._individual_gradients(param, batch_size)
        if individual is None:
            return
        values = param.detach()
        own_ranges = (
            self.spec.gradient_range.compute(individual),
            self.spec.parameter_range.compute(values),
        )
        bins, out_of_range = self.spec.bins, _OUT_OF_RANGE[self.spec.semantics]
        own = histogram2d(
            individual, values, *own_ranges, bins, out_of_range=out_of_range
        )
        if self.spec.semantics == "cockpit":
            # Binned in assemble; the values as they are now, before any update.
            network = (individual.detach(), values.clone())
        elif own_ranges != self.network_ranges:
            network = histogram2d(individual, values, *self.network_ranges, bins)
        else:
            network = own
        self._pieces[id(param)] = (own_ranges, own, network)

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Per-parameter and network 2D histograms; update the next network ranges.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples (unused).

        Returns:
            Record entries (tensors).
        """
        label = self.spec.label
        entries: Entries = {}
        gradient_ranges, parameter_ranges, network = [], [], []
        for name, param in named_params:
            (gradient_range, parameter_range), own, in_network = _pieces_of(
                self._pieces, name, param, "grad_batch"
            )
            entries.update(_histogram2d_entries(label, own, f"/{name}"))
            gradient_ranges.append(gradient_range)
            parameter_ranges.append(parameter_range)
            network.append(in_network)
        self.network_ranges = (
            range_hull(gradient_ranges),
            range_hull(parameter_ranges),
        )
        if self.spec.semantics == "cockpit":
            network = [
                histogram2d(
                    individual,
                    values,
                    *self.network_ranges,
                    self.spec.bins,
                    out_of_range="clamp",
                )
                for individual, values in network
            ]
        total = _summed(network, ("counts", "margins", "nan"))
        entries.update(_histogram2d_entries(label, total, ""))
        return entries


def _histogram2d_entries(label: str, histogram, suffix: str) -> Entries:
    return _entries(
        label, histogram, suffix, ("counts", "x_edges", "y_edges", "margins", "nan")
    )


class CurvatureTraceReducer:
    """Traces of a diagonal curvature, per parameter and total."""

    def __init__(self, spec: CurvatureTrace) -> None:
        """Create the reducer.

        Args:
            spec: The trace diagnostic.
        """
        self.spec = spec
        self._pieces: dict[int, Tensor] = {}

    def extensions(self) -> list[BackpropExtension]:
        """Return the diagonal curvature extension of the spec."""
        return [curvature_extension(self.spec.curvature, self.spec.mc_samples)]

    def begin(self) -> None:
        """Forget the pieces of the previous step."""
        self._pieces = {}

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Sum the parameter's diagonal curvature.

        Args:
            param: Parameter whose module's backward just ran.
            batch_size: Number of samples (unused).
        """
        diagonal = _quantity(param, self.spec.curvature)
        if diagonal is not None:
            self._pieces[id(param)] = diagonal_trace(diagonal)

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Per-parameter traces and their total.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples (unused).

        Returns:
            Record entries (0-dim tensors).
        """
        key = f"{self.spec.label}/trace"
        traces = {
            name: _pieces_of(self._pieces, name, param, self.spec.curvature)
            for name, param in named_params
        }
        entries: Entries = {f"{key}/{name}": trace for name, trace in traces.items()}
        entries[key] = total_trace(traces.values())
        return entries


def make_reducer(spec: Diagnostic) -> Reducer:
    """Create the reducer of a diagnostic spec.

    Args:
        spec: Any diagnostic from :mod:`dampednewton.diagnostics.specs`.

    Returns:
        A fresh reducer.

    Raises:
        TypeError: If ``spec`` is not a known diagnostic.
    """
    reducers = {
        GSNR: GSNRReducer,
        NoiseScale: NoiseScaleReducer,
        GradientHistogram: GradientHistogramReducer,
        GradientParameterHistogram: GradientParameterHistogramReducer,
        CurvatureTrace: CurvatureTraceReducer,
    }
    try:
        return reducers[type(spec)](spec)
    except KeyError:
        raise TypeError(
            f"Unknown diagnostic {spec!r}; use one of "
            f"{[cls.__name__ for cls in reducers]}."
        ) from None
