"""Bin-range adaptation: pure functions that choose a histogram range from data.

Three policies (small frozen dataclasses that call the functions below):

* :class:`FixedRange`: always the same range.
* :class:`MaxAbsRange`: ``±max|x|·(1 + padding)``, symmetric about 0; every finite
  value is inside, but a single outlier squeezes the bulk into few bins.
* :class:`PercentileRange`: the ``[lower, upper]`` percentiles widened by
  ``padding`` times their distance; the bulk fills the bins and outliers stay
  visible as the ``below``/``above`` counts of the histogram.

Only finite values enter the statistics (infinities and NaNs are counted by the
histogram, not used to place it). Degenerate data fall back: a percentile range of
zero width to the max-abs range, a max-abs range of zero width (all values 0, or
none finite) to :data:`FALLBACK_RANGE`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

FALLBACK_RANGE: tuple[float, float] = (-1.0, 1.0)
"""Range used when the data do not define one (no finite or only zero values)."""


def finite_values(values: Tensor) -> Tensor:
    """Return the finite elements of ``values`` as a flat tensor.

    Args:
        values: Floating-point tensor, any shape.

    Returns:
        1-D tensor of the finite elements, in memory order.
    """
    flat = values.detach().reshape(-1)
    return flat[torch.isfinite(flat)]


def quantile(values: Tensor, q: float) -> float:
    """``q``-th percentile of the finite elements, linearly interpolated.

    Matches ``numpy.percentile(x, q)`` (``method="linear"``) up to round-off and,
    unlike ``torch.quantile``, has no limit on the number of elements.

    Args:
        values: Floating-point tensor, any shape.
        q: Percentile in ``[0, 100]``.

    Returns:
        The percentile as a Python float.

    Raises:
        ValueError: If ``q`` is outside ``[0, 100]`` or no element is finite.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"Percentile must be in [0, 100], got {q}.")
    finite = finite_values(values)
    if finite.numel() == 0:
        raise ValueError("Cannot compute a percentile: no finite values.")
    position = q / 100.0 * (finite.numel() - 1)
    below = math.floor(position)
    fraction = position - below
    lower = finite.kthvalue(below + 1).values.item()
    if fraction == 0.0:
        return lower
    upper = finite.kthvalue(below + 2).values.item()
    return lower + fraction * (upper - lower)


def largest_finite_magnitude(values: Tensor) -> float:
    """Largest absolute value among the finite elements (``0.0`` if none).

    Args:
        values: Floating-point tensor, any shape.

    Returns:
        ``max|x|`` over the finite elements, as a Python float.
    """
    if values.numel() == 0:
        return 0.0
    largest = values.detach().abs().amax().item()
    if math.isfinite(largest):
        return largest
    # Only with infinities or NaNs (which propagate through amax): filter them.
    finite = finite_values(values)
    return finite.abs().amax().item() if finite.numel() > 0 else 0.0


def _check_padding(padding: float) -> None:
    if not (math.isfinite(padding) and padding >= 0):
        raise ValueError(f"padding must be finite and ≥ 0, got {padding}.")


def max_abs_range(values: Tensor, padding: float) -> tuple[float, float]:
    """Symmetric range ``±max|x|·(1 + padding)`` over the finite elements.

    Args:
        values: Floating-point tensor, any shape.
        padding: Relative widening, ``≥ 0``.

    Returns:
        ``(low, high)``; :data:`FALLBACK_RANGE` if no element is finite and
        non-zero.

    Raises:
        ValueError: If ``padding`` is negative or not finite.
    """
    return max_abs_range_of_magnitude(largest_finite_magnitude(values), padding)


def max_abs_range_of_magnitude(largest: float, padding: float) -> tuple[float, float]:
    """Symmetric range ``±largest·(1 + padding)`` from a largest finite magnitude.

    :func:`max_abs_range` of data whose largest finite magnitude is ``largest``.

    Args:
        largest: Largest finite magnitude of the data (``≥ 0``).
        padding: Relative widening, ``≥ 0``.

    Returns:
        ``(low, high)``; :data:`FALLBACK_RANGE` if ``largest`` is 0.

    Raises:
        ValueError: If ``padding`` is negative or not finite.
    """
    _check_padding(padding)
    half_width = largest * (1.0 + padding)
    if not half_width > 0 or not math.isfinite(half_width):
        return FALLBACK_RANGE
    return (-half_width, half_width)


def percentile_range(
    values: Tensor, lower: float, upper: float, padding: float
) -> tuple[float, float]:
    """Range between two percentiles, widened by ``padding`` times its width.

    Args:
        values: Floating-point tensor, any shape.
        lower: Lower percentile in ``[0, 100)``.
        upper: Upper percentile in ``(lower, 100]``.
        padding: Relative widening on each side, ``≥ 0``.

    Returns:
        ``(q_lower − padding·w, q_upper + padding·w)`` with ``w = q_upper −
        q_lower``; the max-abs range if ``w = 0``, :data:`FALLBACK_RANGE` if no
        element is finite.

    Raises:
        ValueError: If the percentiles are not ordered within ``[0, 100]`` or
            ``padding`` is invalid.
    """
    _check_percentiles(lower, upper)
    _check_padding(padding)
    finite = finite_values(values)
    if finite.numel() == 0:
        return FALLBACK_RANGE
    low, high = quantile(finite, lower), quantile(finite, upper)
    width = high - low
    if not width > 0:
        return max_abs_range(finite, padding)
    return (low - padding * width, high + padding * width)


def range_hull(ranges: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """Smallest range that contains all given ranges.

    Args:
        ranges: ``(low, high)`` pairs.

    Returns:
        ``(min of lows, max of highs)``.

    Raises:
        ValueError: If ``ranges`` is empty.
    """
    ranges = list(ranges)
    if not ranges:
        raise ValueError("range_hull needs at least one range.")
    return (min(low for low, _ in ranges), max(high for _, high in ranges))


def _check_percentiles(lower: float, upper: float) -> None:
    if not 0.0 <= lower < upper <= 100.0:
        raise ValueError(
            f"Percentiles must satisfy 0 ≤ lower < upper ≤ 100, got ({lower}, {upper})."
        )


@dataclass(frozen=True)
class FixedRange:
    """Always the range ``(low, high)``.

    Attributes:
        low: Lower end (finite).
        high: Upper end (finite, ``> low``).
    """

    low: float = -1.0
    high: float = 1.0

    def __post_init__(self) -> None:
        """Validate the range.

        Raises:
            ValueError: If the range is not finite and increasing.
        """
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise ValueError(f"Range must be finite, got ({self.low}, {self.high}).")
        if not self.low < self.high:
            raise ValueError(f"Need low < high, got ({self.low}, {self.high}).")

    def compute(self, values: Tensor) -> tuple[float, float]:
        """Return the fixed range (``values`` is ignored).

        Args:
            values: Data to be binned (unused).

        Returns:
            ``(low, high)``.
        """
        return (self.low, self.high)


@dataclass(frozen=True)
class MaxAbsRange:
    """Symmetric range from the largest absolute finite value.

    Attributes:
        padding: Relative widening, ``≥ 0``.
    """

    padding: float = 0.05

    def __post_init__(self) -> None:
        """Validate the padding.

        Raises:
            ValueError: If ``padding`` is negative or not finite.
        """
        _check_padding(self.padding)

    def compute(self, values: Tensor) -> tuple[float, float]:
        """Return :func:`max_abs_range` of ``values``.

        Args:
            values: Data to be binned.

        Returns:
            ``(low, high)``.
        """
        return max_abs_range(values, self.padding)


@dataclass(frozen=True)
class PercentileRange:
    """Range between two percentiles, padded; outliers land in below/above counts.

    Attributes:
        lower: Lower percentile in ``[0, 100)``.
        upper: Upper percentile in ``(lower, 100]``.
        padding: Widening on each side, relative to the percentile distance.
    """

    lower: float = 1.0
    upper: float = 99.0
    padding: float = 0.05

    def __post_init__(self) -> None:
        """Validate the percentiles and padding.

        Raises:
            ValueError: If the percentiles are not ordered in ``[0, 100]`` or
                ``padding`` is invalid.
        """
        _check_percentiles(self.lower, self.upper)
        _check_padding(self.padding)

    def compute(self, values: Tensor) -> tuple[float, float]:
        """Return :func:`percentile_range` of ``values``.

        Args:
            values: Data to be binned.

        Returns:
            ``(low, high)``.
        """
        return percentile_range(values, self.lower, self.upper, self.padding)


RangePolicy = FixedRange | MaxAbsRange | PercentileRange
"""Any of the bin-range policies."""


def range_of_largest_magnitude(
    policy: RangePolicy, largest: float
) -> tuple[float, float]:
    """The range ``policy`` picks for data of a given largest finite magnitude.

    The data's ranks agree on a range by the maximum of their magnitudes alone:
    :class:`FixedRange` ignores the data, :class:`MaxAbsRange` needs nothing else.

    Args:
        policy: A :class:`FixedRange` or a :class:`MaxAbsRange`.
        largest: Largest finite magnitude of the data.

    Returns:
        ``(low, high)``, as ``policy.compute`` on the data.

    Raises:
        ValueError: For a :class:`PercentileRange` (it needs the values).
    """
    if isinstance(policy, FixedRange):
        return (policy.low, policy.high)
    if isinstance(policy, MaxAbsRange):
        return max_abs_range_of_magnitude(largest, policy.padding)
    raise ValueError(
        f"{type(policy).__name__} needs every rank's values, which a monitor under "
        "torch.distributed does not exchange: use MaxAbsRange or FixedRange."
    )
