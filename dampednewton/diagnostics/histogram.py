"""Histograms with uniform bins and complete accounting of every element.

Pure tensor functions, no state; they run on the device of their inputs and do not
synchronize with it.

Binning follows ``numpy.histogram``: the edges are ``numpy.linspace(low, high,
bins + 1)`` (cast to the data's dtype), bin ``i`` holds ``edges[i] ≤ x <
edges[i + 1]`` and the last bin also holds ``x = high``.

By default (``out_of_range="count"``) out-of-range values are **not** put into the
edge bins: they are counted separately as ``below`` (``x < low``, including
``−inf``) and ``above`` (``x > high``, including ``+inf``), and NaNs as ``nan``.
Hence the bin counts equal ``numpy.histogram`` of the same data with the same range,
and ``counts.sum() + below + above + nan`` is the number of elements.

With ``out_of_range="clamp"`` (Cockpit's histograms) out-of-range values are clamped
into the edge bins, so the counts equal ``numpy.histogram`` of
``numpy.clip(x, low, high)``; ``below`` and ``above`` still say how many were
clamped, and ``counts.sum() + nan`` is the number of elements. In two dimensions
each coordinate is clamped into its range.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import numpy as np
import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 2**22
"""Elements binned at once; bounds the temporary memory of large inputs."""

OutOfRange = Literal["count", "clamp"]
"""Out-of-range values: ``"count"`` them separately, or ``"clamp"`` them into the
edge bins."""


def check_out_of_range(out_of_range: str) -> None:
    """Validate an :data:`OutOfRange` value.

    Args:
        out_of_range: The value to check.

    Raises:
        ValueError: If it is not one of :data:`OutOfRange`.
    """
    if out_of_range not in get_args(OutOfRange):
        raise ValueError(
            f"out_of_range must be one of {get_args(OutOfRange)}, got {out_of_range!r}."
        )


class Histogram1d(NamedTuple):
    """Counts of a one-dimensional histogram.

    Attributes:
        counts: Counts per bin, int64 of shape ``[bins]``.
        edges: Bin edges, shape ``[bins + 1]``, dtype of the data.
        below: Number of values ``< low`` (0-dim int64); clamped into the first bin
            with ``out_of_range="clamp"``.
        above: Number of values ``> high`` (0-dim int64); clamped into the last bin
            with ``out_of_range="clamp"``.
        nan: Number of NaNs (0-dim int64).
    """

    counts: Tensor
    edges: Tensor
    below: Tensor
    above: Tensor
    nan: Tensor


class Histogram2d(NamedTuple):
    """Counts of a two-dimensional histogram of pairs ``(x, y)``.

    Attributes:
        counts: Counts per bin, int64 of shape ``[x_bins, y_bins]`` (``x`` along
            the rows, as ``numpy.histogram2d``).
        x_edges: Bin edges along ``x``, shape ``[x_bins + 1]``.
        y_edges: Bin edges along ``y``, shape ``[y_bins + 1]``.
        margins: int64 ``[3, 3]``: pairs without NaN by the region of ``x`` (row)
            and of ``y`` (column), each ``0`` below, ``1`` inside, ``2`` above the
            range; ``margins[1, 1] == counts.sum()`` unless out-of-range pairs were
            clamped into the edge bins.
        nan: Number of pairs with a NaN in ``x`` or ``y`` (0-dim int64).
    """

    counts: Tensor
    x_edges: Tensor
    y_edges: Tensor
    margins: Tensor
    nan: Tensor


def uniform_bin_edges(
    low: float, high: float, bins: int, *, like: Tensor | None = None
) -> Tensor:
    """Edges of ``bins`` equal bins on ``[low, high]``, bitwise as ``numpy.linspace``.

    Args:
        low: Lower end of the range (finite).
        high: Upper end of the range (finite, ``> low``).
        bins: Number of bins (``≥ 1``).
        like: Tensor whose dtype and device the edges take (default: float64, CPU).

    Returns:
        Strictly increasing tensor of shape ``[bins + 1]``.

    Raises:
        ValueError: If the range is not finite and increasing, ``bins < 1``, or the
            range is too narrow to give distinct edges in the requested dtype.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be an integer ≥ 1, got {bins!r}.")
    if not (np.isfinite(low) and np.isfinite(high) and low < high):
        raise ValueError(
            f"Histogram range must be finite with low < high, got ({low}, {high})."
        )
    edges = torch.from_numpy(np.linspace(float(low), float(high), bins + 1))
    if like is not None:
        edges = edges.to(dtype=like.dtype)
    if not bool((edges[1:] > edges[:-1]).all()):
        raise ValueError(
            f"Range ({low}, {high}) is too narrow for {bins} distinct bins in "
            f"{edges.dtype}; widen the range or use fewer bins."
        )
    return edges if like is None else edges.to(device=like.device)


def _bin_codes(values: Tensor, edges: Tensor) -> Tensor:
    """Code per value: 0 below, ``i + 1`` in bin ``i``, ``B + 1`` above, ``B + 2`` NaN.

    Args:
        values: Data, any shape, same dtype and device as ``edges``.
        edges: Increasing edges of ``B`` bins.

    Returns:
        int64 codes shaped like ``values``.
    """
    bins = edges.numel() - 1
    # right=True: code i means edges[i − 1] ≤ x < edges[i]; x = high, +inf and NaN
    # all get B + 1 and are then told apart.
    codes = torch.bucketize(values, edges, right=True)
    codes.masked_fill_(values == edges[-1], bins)
    codes.masked_fill_(values.isnan(), bins + 2)
    return codes


def _clamped(table: Tensor, bins: int, dim: int) -> Tensor:
    """Inner bins of ``table`` along ``dim`` with the below/above codes folded in.

    Args:
        table: Counts by code along ``dim`` (``0`` below, ``1..bins``, ``bins + 1``
            above, NaN codes excluded).
        bins: Number of inner bins.
        dim: Dimension of the codes.

    Returns:
        ``bins`` entries along ``dim``: the first bin also holds the values below,
        the last bin those above.
    """
    inner = table.narrow(dim, 1, bins).clone()
    inner.narrow(dim, 0, 1).add_(table.narrow(dim, 0, 1))
    inner.narrow(dim, bins - 1, 1).add_(table.narrow(dim, bins + 1, 1))
    return inner


def _collapse(table: Tensor, bins: int, dim: int) -> Tensor:
    """Sum the codes of ``table`` along ``dim`` into below, inside, above."""
    return torch.stack(
        [
            table.narrow(dim, 0, 1).sum(dim),
            table.narrow(dim, 1, bins).sum(dim),
            table.narrow(dim, bins + 1, 1).sum(dim),
        ],
        dim,
    )


def _check_floating(name: str, values: Tensor) -> None:
    if not values.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {values.dtype}.")


def histogram1d(
    values: Tensor,
    low: float,
    high: float,
    bins: int,
    *,
    out_of_range: OutOfRange = "count",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Histogram1d:
    """Histogram of all elements of ``values`` on ``[low, high]``.

    Args:
        values: Floating-point data, any shape.
        low: Lower end of the range.
        high: Upper end of the range.
        bins: Number of bins.
        out_of_range: ``"count"`` out-of-range values separately, or ``"clamp"``
            them into the edge bins.
        chunk_size: Number of elements binned at once.

    Returns:
        Counts, edges and the out-of-range/NaN counts, on the device of ``values``.

    Raises:
        TypeError: If ``values`` is not floating-point.
        ValueError: If the range, ``bins`` or ``out_of_range`` is invalid, or
            ``chunk_size < 1``.
    """
    _check_floating("values", values)
    _check_chunk_size(chunk_size)
    check_out_of_range(out_of_range)
    edges = uniform_bin_edges(low, high, bins, like=values)
    totals = torch.zeros(bins + 3, dtype=torch.int64, device=values.device)
    for chunk in values.detach().reshape(-1).split(chunk_size):
        totals += torch.bincount(_bin_codes(chunk, edges), minlength=bins + 3)
    if out_of_range == "clamp":
        counts = _clamped(totals[: bins + 2], bins, 0)
    else:
        counts = totals[1 : bins + 1]
    return Histogram1d(
        counts=counts,
        edges=edges,
        below=totals[0],
        above=totals[bins + 1],
        nan=totals[bins + 2],
    )


def histogram2d(
    x: Tensor,
    y: Tensor,
    x_range: tuple[float, float],
    y_range: tuple[float, float],
    bins: tuple[int, int],
    *,
    out_of_range: OutOfRange = "count",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Histogram2d:
    """Histogram of the pairs ``(x[i], y[i])`` after broadcasting ``x`` and ``y``.

    Broadcasting lets ``y`` be a parameter (shape ``s``) paired with every
    per-sample gradient ``x`` (shape ``[N, *s]``) without copying it ``N`` times.

    Args:
        x: Floating-point data along the first axis.
        y: Floating-point data along the second axis, broadcastable with ``x``.
        x_range: ``(low, high)`` along ``x``.
        y_range: ``(low, high)`` along ``y``.
        bins: Number of bins along ``x`` and ``y``.
        out_of_range: ``"count"`` pairs outside the ranges only in ``margins``, or
            ``"clamp"`` each coordinate into its edge bins (``margins`` still tell
            where the pairs were).
        chunk_size: Approximate number of pairs binned at once.

    Returns:
        Counts, edges, margins and NaN count, on the device of ``x``.

    Raises:
        TypeError: If ``x`` or ``y`` is not floating-point.
        ValueError: If a range, ``bins`` or ``out_of_range`` is invalid, the shapes
            do not broadcast, or ``chunk_size < 1``.
    """
    _check_floating("x", x)
    _check_floating("y", y)
    _check_chunk_size(chunk_size)
    check_out_of_range(out_of_range)
    if len(bins) != 2:
        raise ValueError(f"bins must be a pair (x_bins, y_bins), got {bins!r}.")
    x_bins, y_bins = bins
    x_edges = uniform_bin_edges(*x_range, x_bins, like=x)
    y_edges = uniform_bin_edges(*y_range, y_bins, like=y)
    y_codes = _bin_codes(y.detach(), y_edges)
    try:
        shape = torch.broadcast_shapes(x.shape, y.shape)
    except RuntimeError as error:
        raise ValueError(
            f"x and y must broadcast, got shapes {tuple(x.shape)} and {tuple(y.shape)}."
        ) from error
    # Rows of the broadcast pairs; the expanded y codes stay a view until chunked.
    rows = shape[0] if len(shape) > 0 else 1
    columns = math.prod(shape[1:])
    x_rows = x.detach().expand(shape).reshape(rows, columns)
    y_codes = y_codes.expand(shape).reshape(rows, columns)
    x_codes, y_codes_count = x_bins + 3, y_bins + 3
    table = torch.zeros(x_codes * y_codes_count, dtype=torch.int64, device=x.device)
    step = max(1, chunk_size // max(1, columns))
    for start in range(0, rows, step):
        block = slice(start, start + step)
        code = _bin_codes(x_rows[block].reshape(-1), x_edges) * y_codes_count
        code += y_codes[block].reshape(-1)
        table += torch.bincount(code, minlength=x_codes * y_codes_count)
    table = table.reshape(x_codes, y_codes_count)
    without_nan = table[: x_bins + 2, : y_bins + 2]
    if out_of_range == "clamp":
        counts = _clamped(_clamped(without_nan, x_bins, 0), y_bins, 1)
    else:
        counts = table[1 : x_bins + 1, 1 : y_bins + 1]
    return Histogram2d(
        counts=counts,
        x_edges=x_edges,
        y_edges=y_edges,
        margins=_collapse(_collapse(without_nan, x_bins, 0), y_bins, 1),
        nan=table[x_bins + 2, :].sum() + table[: x_bins + 2, y_bins + 2].sum(),
    )


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}.")


def pairs_outside(margins: np.ndarray | Tensor) -> int:
    """The pairs of a 2D histogram outside its ranges, from its ``margins``.

    ``margins`` counts the pairs in the 3×3 regions below, inside and above each
    axis' range; the centre is inside both. With ``out_of_range="clamp"`` the bins
    hold the clamped pairs too, so only the regions tell how many were outside.

    Args:
        margins: ``[3, 3]`` counts.

    Returns:
        The pairs outside at least one range.
    """
    regions = np.asarray(margins)
    return int(regions.sum() - regions[1, 1])
