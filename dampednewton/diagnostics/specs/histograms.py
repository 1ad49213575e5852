"""Histograms of individual gradients (1D) and of gradient–parameter pairs (2D).

Both specs share one reducer
(:mod:`~dampednewton.diagnostics.specs.histogram_reducer`); a spec says how many axes
it bins, their range policies and the histogram function. Binning and the accounting of
out-of-range values are in :mod:`dampednewton.diagnostics.histogram`, range policies
in :mod:`dampednewton.diagnostics.bin_adaptation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from torch import Tensor

from dampednewton.diagnostics.bin_adaptation import (
    FALLBACK_RANGE,
    MaxAbsRange,
    RangePolicy,
)
from dampednewton.diagnostics.histogram import (
    Histogram1d,
    Histogram2d,
    OutOfRange,
    histogram1d,
    histogram2d,
)
from dampednewton.diagnostics.schedules import EveryKSteps, Schedule
from dampednewton.diagnostics.specs.checks import (
    check_count,
    check_label,
    check_policy,
    check_range,
    check_schedule,
)
from dampednewton.diagnostics.specs.histogram_reducer import HistogramReducer

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
        if not isinstance(self.bins, tuple | list) or len(self.bins) != 2:
            raise ValueError(
                "bins must be a pair of integers (gradient bins, parameter bins), "
                f"got {self.bins!r}."
            )
        bins = tuple(self.bins)
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
