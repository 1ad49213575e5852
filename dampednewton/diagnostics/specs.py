"""What to compute: one small frozen (picklable) dataclass per diagnostic.

Each diagnostic has a :mod:`schedule <dampednewton.diagnostics.schedules>` and a
``label`` that prefixes its keys in the per-step record. Keys are
``"{label}/{field}"`` for the whole network and ``"{label}/{field}/{name}"`` for
the parameter called ``name``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from dampednewton.diagnostics.bin_adaptation import (
    FALLBACK_RANGE,
    MaxAbsRange,
    RangePolicy,
)
from dampednewton.diagnostics.schedules import EveryKSteps, Schedule
from dampednewton.diagnostics.trace import check_curvature

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


def _check_label(label: str) -> None:
    if not isinstance(label, str) or not label or "/" in label:
        raise ValueError(
            f"label must be a non-empty string without '/', got {label!r}."
        )


def _check_schedule(schedule: Schedule) -> None:
    if not callable(schedule):
        raise TypeError(
            f"schedule must be callable as schedule(step) -> bool, got {schedule!r}."
        )


def _check_policy(name: str, policy: RangePolicy) -> None:
    if not callable(getattr(policy, "compute", None)):
        raise TypeError(
            f"{name} must be a range policy with a compute(values) method (e.g. "
            f"FixedRange, MaxAbsRange, PercentileRange), got {policy!r}."
        )


def _check_range(name: str, value: tuple[float, float]) -> tuple[float, float]:
    low, high = (float(v) for v in value)
    if not low < high:
        raise ValueError(f"{name} must be (low, high) with low < high, got {value}.")
    return (low, high)


def _check_bins(name: str, bins: int) -> None:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"{name} must be an integer ≥ 1, got {bins!r}.")


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
        _check_schedule(self.schedule)
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon must be ≥ 0, got {self.epsilon}.")
        _check_label(self.label)


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
        _check_schedule(self.schedule)
        _check_label(self.label)


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
        _check_schedule(self.schedule)
        _check_bins("bins", self.bins)
        _check_policy("range_policy", self.range_policy)
        object.__setattr__(
            self, "initial_range", _check_range("initial_range", self.initial_range)
        )
        _check_label(self.label)
        _check_semantics(self.semantics)


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
        _check_schedule(self.schedule)
        bins = tuple(self.bins)
        if len(bins) != 2:
            raise ValueError(f"bins must be a pair of integers, got {self.bins!r}.")
        for bin_count in bins:
            _check_bins("bins", bin_count)
        object.__setattr__(self, "bins", bins)
        _check_policy("gradient_range", self.gradient_range)
        _check_policy("parameter_range", self.parameter_range)
        for name in ("initial_gradient_range", "initial_parameter_range"):
            object.__setattr__(self, name, _check_range(name, getattr(self, name)))
        _check_label(self.label)
        _check_semantics(self.semantics)


@dataclass(frozen=True)
class CurvatureTrace:
    """Trace of a diagonal curvature (Hessian, exact or Monte-Carlo GGN).

    Record keys: ``{label}/trace`` (total) and ``{label}/trace/{name}``.

    Attributes:
        schedule: When to compute.
        curvature: ``"diag_h"``, ``"diag_ggn_exact"`` or ``"diag_ggn_mc"``.
        mc_samples: Monte-Carlo samples of ``diag_ggn_mc``.
        label: Key prefix; ``None`` uses the curvature name.
    """

    schedule: Schedule = field(default_factory=EveryKSteps)
    curvature: str = "diag_ggn_exact"
    mc_samples: int = 1
    label: str | None = None

    def __post_init__(self) -> None:
        """Validate the fields and fill in the default label.

        Raises:
            ValueError: If the curvature, ``mc_samples`` or the label is invalid.
        """
        _check_schedule(self.schedule)
        check_curvature(self.curvature)
        _check_bins("mc_samples", self.mc_samples)
        if self.label is None:
            object.__setattr__(self, "label", self.curvature)
        _check_label(self.label)


Diagnostic = (
    GSNR | NoiseScale | GradientHistogram | GradientParameterHistogram | CurvatureTrace
)
"""Any of the diagnostics."""
