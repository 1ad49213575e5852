"""Histograms of individual gradients (1D) and of gradient–parameter pairs (2D).

Both specs share one :class:`HistogramReducer`; a spec says how many axes it bins,
their range policies and the histogram function. Binning and the accounting of
out-of-range values are in :mod:`dampednewton.diagnostics.histogram`, range policies
in :mod:`dampednewton.diagnostics.bin_adaptation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from backpack.extensions import BatchGrad
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor

from dampednewton.backpack.savefields import GRAD_BATCH
from dampednewton.diagnostics.bin_adaptation import (
    FALLBACK_RANGE,
    MaxAbsRange,
    RangePolicy,
    range_hull,
)
from dampednewton.diagnostics.histogram import (
    Histogram1d,
    Histogram2d,
    OutOfRange,
    histogram1d,
    histogram2d,
)
from dampednewton.diagnostics.reducer import Entries, NamedParams, pieces_of, quantity
from dampednewton.diagnostics.schedules import EveryKSteps, Schedule
from dampednewton.diagnostics.specs.checks import (
    check_count,
    check_label,
    check_policy,
    check_range,
    check_schedule,
)

HistogramSemantics = Literal["dampednewton", "cockpit"]
"""How histograms treat out-of-range values and choose the network range.

* ``"dampednewton"`` (the default): out-of-range values are counted separately
  (``below``/``above``, ``margins``); the network histogram is filled while the layers
  stream by, in the hull of the per-parameter ranges of the previous tracked step.
* ``"cockpit"`` (Cockpit's ``GradHist1d``/``GradHist2d``): out-of-range values are
  clamped into the edge bins; the network histogram uses the hull of this step's
  per-parameter ranges, so the layers' individual gradients are kept until the record
  is assembled (memory ``N·D``).
"""


def _check_semantics(semantics: str) -> None:
    if semantics not in get_args(HistogramSemantics):
        raise ValueError(
            f"semantics must be one of {get_args(HistogramSemantics)}, got "
            f"{semantics!r}."
        )


_OUT_OF_RANGE: dict[str, OutOfRange] = {"dampednewton": "count", "cockpit": "clamp"}
"""How each histogram semantics bins out-of-range values."""

_FIELDS = {
    Histogram1d: (
        ("counts", "edges", "below", "above", "nan"),
        ("counts", "below", "above", "nan"),
    ),
    Histogram2d: (
        ("counts", "x_edges", "y_edges", "margins", "nan"),
        ("counts", "margins", "nan"),
    ),
}
"""Per histogram type: the record fields, and those summed into the network's."""

Ranges = tuple[tuple[float, float], ...]
"""One ``(low, high)`` range per axis."""


def check_semantics(semantics: str) -> None:
    """Raise ``ValueError`` unless ``semantics`` is a :data:`HistogramSemantics`."""
    if semantics not in get_args(HistogramSemantics):
        raise ValueError(
            f"semantics must be one of {get_args(HistogramSemantics)}, got "
            f"{semantics!r}."
        )


@dataclass(frozen=True)
class GradientHistogram:
    """Histogram of the individual gradient elements ``∇ℓ_n`` (``N·grad_batch``).

    One histogram per parameter, with its range from ``range_policy`` applied to
    that parameter's current individual gradients, and one for the whole network.
    With ``semantics="dampednewton"`` the network histogram is filled while the
    layers stream by, so its range is the hull of the per-parameter ranges of the
    previous tracked step (``initial_range`` at the first one), and out-of-range
    values are counted separately (see :mod:`dampednewton.diagnostics.histogram`).
    With ``semantics="cockpit"`` out-of-range values are clamped into the edge bins
    and the network range is the hull of this step's per-parameter ranges
    (:data:`HistogramSemantics`). NaNs are counted separately in both.

    Record keys (``{label}/…``, per parameter with ``/{name}``): ``counts``,
    ``edges``, ``below``, ``above``, ``nan``.

    Attributes:
        schedule: When to compute.
        bins: Number of bins.
        range_policy: How the range follows the data.
        initial_range: Range of the network histogram at the first tracked step
            (``"dampednewton"`` semantics).
        label: Key prefix.
        semantics: ``"dampednewton"`` or ``"cockpit"`` (:data:`HistogramSemantics`).
    """

    schedule: Schedule = field(default_factory=EveryKSteps)
    bins: int = 64
    range_policy: RangePolicy = field(default_factory=MaxAbsRange)
    initial_range: tuple[float, float] = FALLBACK_RANGE
    label: str = "grad_hist"
    semantics: HistogramSemantics = "dampednewton"

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            ValueError: If ``bins``, ``initial_range``, the label or ``semantics`` is
                invalid.
            TypeError: If ``range_policy`` has no ``compute`` method.
        """
        check_schedule(self.schedule)
        check_count("bins", self.bins)
        check_policy("range_policy", self.range_policy)
        object.__setattr__(
            self, "initial_range", check_range("initial_range", self.initial_range)
        )
        check_label(self.label)
        check_semantics(self.semantics)

    @property
    def range_policies(self) -> tuple[RangePolicy]:
        """The range policy of the one axis, individual gradient elements."""
        return (self.range_policy,)

    @property
    def initial_ranges(self) -> tuple[tuple[float, float]]:
        """The network histogram's range at the first tracked step."""
        return (self.initial_range,)

    def binned(
        self,
        axes: tuple[Tensor, ...],
        ranges: tuple[tuple[float, float], ...],
        out_of_range: OutOfRange,
    ) -> Histogram1d:
        """Histogram of the individual gradient elements ``axes[0]`` in ``ranges``."""
        ((low, high),) = ranges
        return histogram1d(axes[0], low, high, self.bins, out_of_range=out_of_range)

    def make_reducer(self) -> HistogramReducer:
        """A fresh :class:`HistogramReducer` that computes this diagnostic."""
        return HistogramReducer(self, pairs_with_values=False)


@dataclass(frozen=True)
class GradientParameterHistogram:
    """2D histogram of (individual gradient element, parameter value) pairs.

    Each element of ``∇ℓ_n`` is paired with the value of its parameter entry, so a
    parameter of ``D`` entries contributes ``N·D`` pairs. Ranges and ``semantics``
    work as in :class:`GradientHistogram`, separately for both axes (Cockpit's
    clamps each coordinate into its edge bins).

    Record keys (``{label}/…``, per parameter with ``/{name}``): ``counts``
    (``[gradient bins, parameter bins]``), ``x_edges`` (gradients), ``y_edges``
    (parameters), ``margins`` and ``nan``.

    Attributes:
        schedule: When to compute.
        bins: Number of bins along the gradient and the parameter axis.
        gradient_range: Range policy of the gradient axis.
        parameter_range: Range policy of the parameter axis.
        initial_gradient_range: Gradient range of the network histogram at the
            first tracked step.
        initial_parameter_range: Parameter range of the network histogram at the
            first tracked step.
        label: Key prefix.
        semantics: ``"dampednewton"`` or ``"cockpit"`` (:data:`HistogramSemantics`).
    """

    schedule: Schedule = field(default_factory=EveryKSteps)
    bins: tuple[int, int] = (40, 50)
    gradient_range: RangePolicy = field(default_factory=MaxAbsRange)
    parameter_range: RangePolicy = field(default_factory=MaxAbsRange)
    initial_gradient_range: tuple[float, float] = FALLBACK_RANGE
    initial_parameter_range: tuple[float, float] = FALLBACK_RANGE
    label: str = "grad_param_hist"
    semantics: HistogramSemantics = "dampednewton"

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            ValueError: If ``bins``, an initial range, the label or ``semantics`` is
                invalid.
            TypeError: If a range policy has no ``compute`` method.
        """
        check_schedule(self.schedule)
        bins = tuple(self.bins)
        if len(bins) != 2:
            raise ValueError(f"bins must be a pair of integers, got {self.bins!r}.")
        for bin_count in bins:
            check_count("bins", bin_count)
        object.__setattr__(self, "bins", bins)
        check_policy("gradient_range", self.gradient_range)
        check_policy("parameter_range", self.parameter_range)
        for name in ("initial_gradient_range", "initial_parameter_range"):
            object.__setattr__(self, name, check_range(name, getattr(self, name)))
        check_label(self.label)
        check_semantics(self.semantics)

    @property
    def range_policies(self) -> tuple[RangePolicy, RangePolicy]:
        """Range policies of the gradient and the parameter axis."""
        return (self.gradient_range, self.parameter_range)

    @property
    def initial_ranges(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """The network histogram's ranges at the first tracked step."""
        return (self.initial_gradient_range, self.initial_parameter_range)

    def binned(
        self,
        axes: tuple[Tensor, ...],
        ranges: tuple[tuple[float, float], ...],
        out_of_range: OutOfRange,
    ) -> Histogram2d:
        """2D histogram of (gradient element, parameter value) pairs in ``ranges``."""
        gradients, values = axes
        gradient_range, parameter_range = ranges
        return histogram2d(
            gradients,
            values,
            gradient_range,
            parameter_range,
            self.bins,
            out_of_range=out_of_range,
        )

    def make_reducer(self) -> HistogramReducer:
        """A fresh :class:`HistogramReducer` that computes this diagnostic."""
        return HistogramReducer(self, pairs_with_values=True)


class HistogramReducer:
    """Per-parameter and network histograms of a 1D or 2D histogram spec.

    Each parameter is binned in its own range (from the spec's range policies) and,
    for the network histogram, in the network range: with ``"dampednewton"``
    semantics the hull of the per-parameter ranges of the previous tracked step,
    so the layers are binned while they stream by; with ``"cockpit"`` semantics the
    hull of this step's ranges, so the data are kept and binned in :meth:`assemble`.

    Attributes:
        spec: The histogram diagnostic.
        network_ranges: The network histogram's ranges, one per axis.
    """

    def __init__(
        self,
        spec: GradientHistogram | GradientParameterHistogram,
        *,
        pairs_with_values: bool,
    ) -> None:
        """Create the reducer.

        Args:
            spec: The histogram diagnostic.
            pairs_with_values: Pair each gradient element with its parameter's value
                (two axes) instead of binning gradient elements alone.
        """
        self.spec = spec
        self.network_ranges: Ranges = spec.initial_ranges
        self._pairs_with_values = pairs_with_values
        self._pieces: dict[int, tuple] = {}

    def extensions(self) -> list[BackpropExtension]:
        """Return ``[BatchGrad()]``."""
        return [BatchGrad()]

    def begin(self) -> None:
        """Forget the pieces of the previous step."""
        self._pieces = {}

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Bin ``N·grad_batch`` (and the parameter) with own and network ranges.

        Args:
            param: Parameter whose module's backward just ran.
            batch_size: Number of samples ``N``.
        """
        grad_batch = quantity(param, GRAD_BATCH)
        if grad_batch is None:
            return
        axes: tuple[Tensor, ...] = (grad_batch * batch_size,)
        if self._pairs_with_values:
            axes = (*axes, param.detach())
        spec = self.spec
        own_ranges = tuple(
            policy.compute(values)
            for policy, values in zip(spec.range_policies, axes, strict=True)
        )
        own = spec.binned(axes, own_ranges, _OUT_OF_RANGE[spec.semantics])
        if spec.semantics == "cockpit":
            # Binned in assemble; parameter values as they are now, before any update.
            network = (axes[0], *(values.clone() for values in axes[1:]))
        elif own_ranges != self.network_ranges:
            network = spec.binned(axes, self.network_ranges, "count")
        else:
            network = own
        self._pieces[id(param)] = (own_ranges, own, network)

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Per-parameter and network histograms; update the next network ranges.

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
            own_ranges, own, in_network = pieces_of(
                self._pieces, name, param, GRAD_BATCH
            )
            entries.update(_entries(label, own, f"/{name}"))
            ranges.append(own_ranges)
            network.append(in_network)
        self.network_ranges = tuple(
            range_hull(axis) for axis in zip(*ranges, strict=True)
        )
        if self.spec.semantics == "cockpit":
            network = [
                self.spec.binned(axes, self.network_ranges, "clamp") for axes in network
            ]
        entries.update(_entries(label, _summed(network), ""))
        return entries


def _summed(histograms: list):
    """The network histogram: per-parameter ones in the same range, added up."""
    _, summed_fields = _FIELDS[type(histograms[0])]
    return histograms[0]._replace(
        **{
            name: torch.stack([getattr(h, name) for h in histograms]).sum(0)
            for name in summed_fields
        }
    )


def _entries(label: str, histogram, suffix: str) -> Entries:
    fields, _ = _FIELDS[type(histogram)]
    return {f"{label}/{name}{suffix}": getattr(histogram, name) for name in fields}
