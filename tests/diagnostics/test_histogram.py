"""Histograms vs numpy.histogram / numpy.histogram2d, with full element accounting."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dampednewton.diagnostics.histogram import (
    histogram1d,
    histogram2d,
    pairs_outside,
    uniform_bin_edges,
)


@dataclass(frozen=True)
class Data1d:
    """Values and a histogram configuration."""

    id: str
    values: np.ndarray
    low: float
    high: float
    bins: int


def _values_on_edges() -> np.ndarray:
    # 0.3 lies just below numpy's edge 3·0.1 = 0.30000000000000004: a product
    # (x − low)·bins/(high − low) = 3.0000000000000004 would put it one bin too high.
    return np.array(
        [0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0, 1.0, 0.6, 0.30000000000000004]
    )


def _outliers_nan_inf() -> np.ndarray:
    rng = np.random.default_rng(0)
    values = rng.normal(size=500)
    values[:7] = [np.nan, np.inf, -np.inf, 40.0, -40.0, np.nan, 2.0]
    return values


DATA_1D = [
    Data1d("on-edges", _values_on_edges(), 0.0, 1.0, 10),
    Data1d("outliers-nan-inf", _outliers_nan_inf(), -2.0, 2.0, 17),
    Data1d("all-outside", np.array([-5.0, 5.0, np.nan]), -1.0, 1.0, 4),
    Data1d("single-bin", np.linspace(-1, 1, 11), -0.5, 0.5, 1),
    Data1d(
        "float32-shifted",
        np.random.default_rng(1).normal(3.0, 0.5, 300).astype(np.float32),
        2.1,
        3.7,
        9,
    ),
]


@pytest.fixture(params=DATA_1D, ids=lambda data: data.id)
def data_1d(request) -> Data1d:
    return request.param


@pytest.mark.parametrize("chunk_size", [3, 2**22], ids=["chunked", "one-chunk"])
def test_histogram1d_matches_numpy(data_1d, chunk_size):
    hist = histogram1d(
        torch.from_numpy(data_1d.values),
        data_1d.low,
        data_1d.high,
        data_1d.bins,
        chunk_size=chunk_size,
    )
    values = data_1d.values
    expected, expected_edges = np.histogram(
        values, bins=data_1d.bins, range=(data_1d.low, data_1d.high)
    )
    np.testing.assert_array_equal(hist.counts.numpy(), expected, err_msg="counts")
    np.testing.assert_array_equal(hist.edges.numpy(), expected_edges, err_msg="edges")
    with np.errstate(invalid="ignore"):
        below = int((values < data_1d.low).sum())
        above = int((values > data_1d.high).sum())
    assert (hist.below.item(), hist.above.item(), hist.nan.item()) == (
        below,
        above,
        int(np.isnan(values).sum()),
    )
    total = hist.counts.sum() + hist.below + hist.above + hist.nan
    assert total.item() == values.size, "counts must add up to the number of elements"


@pytest.mark.parametrize("chunk_size", [3, 2**22], ids=["chunked", "one-chunk"])
def test_histogram1d_clamp_matches_numpy_of_clipped_values(data_1d, chunk_size):
    """Cockpit's semantics: out-of-range values (and ±inf) land in the edge bins."""
    hist = histogram1d(
        torch.from_numpy(data_1d.values),
        data_1d.low,
        data_1d.high,
        data_1d.bins,
        out_of_range="clamp",
        chunk_size=chunk_size,
    )
    values = data_1d.values
    nan = np.isnan(values)
    clipped = np.clip(values[~nan], data_1d.low, data_1d.high)
    expected, expected_edges = np.histogram(
        clipped, bins=data_1d.bins, range=(data_1d.low, data_1d.high)
    )
    np.testing.assert_array_equal(hist.counts.numpy(), expected, err_msg="counts")
    np.testing.assert_array_equal(hist.edges.numpy(), expected_edges, err_msg="edges")
    clamped = (values[~nan] < data_1d.low).sum(), (values[~nan] > data_1d.high).sum()
    assert (hist.below.item(), hist.above.item()) == clamped
    assert hist.nan.item() == nan.sum()
    assert (hist.counts.sum() + hist.nan).item() == values.size


def test_histogram1d_accepts_any_shape():
    values = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(2, 3, 4)
    flat = histogram1d(values.reshape(-1), -1.0, 1.0, 5)
    assert torch.equal(histogram1d(values, -1.0, 1.0, 5).counts, flat.counts)


def test_edges_are_numpy_linspace_bitwise():
    edges = uniform_bin_edges(-0.3, 0.7, 13)
    np.testing.assert_array_equal(edges.numpy(), np.linspace(-0.3, 0.7, 14))
    like = torch.zeros(1, dtype=torch.float32)
    assert uniform_bin_edges(0.0, 1.0, 4, like=like).dtype == torch.float32


@dataclass(frozen=True)
class Data2d:
    """Pairs (x broadcast against y) and a histogram configuration."""

    id: str
    x: np.ndarray
    y: np.ndarray
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    bins: tuple[int, int]


def _gradients_and_parameters() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 4, 5))  # per-sample gradients of a [4, 5] parameter
    y = rng.normal(size=(4, 5))
    x[0, 0, :3] = [np.nan, 9.0, -9.0]
    x[1, 2, 1] = np.inf
    y[3, 4] = np.nan
    y[0, 1] = 5.0
    y[2, 2] = 0.5  # on an inner y edge
    return x, y


DATA_2D = [
    Data2d(
        "params-broadcast", *_gradients_and_parameters(), (-2, 2), (-1.5, 1.5), (7, 6)
    ),
    Data2d(
        "same-shape",
        np.linspace(-1, 1, 30).reshape(5, 6),
        np.linspace(2, 0, 30).reshape(5, 6),
        (-0.5, 0.5),
        (0.0, 1.0),
        (4, 10),
    ),
]


@pytest.fixture(params=DATA_2D, ids=lambda data: data.id)
def data_2d(request) -> Data2d:
    return request.param


def _histogram2d_of(data, **options):
    """``histogram2d`` of a 2D data case with its ranges and bins."""
    return histogram2d(
        torch.from_numpy(data.x),
        torch.from_numpy(data.y),
        data.x_range,
        data.y_range,
        data.bins,
        **options,
    )


def _flat_pairs(data) -> tuple[np.ndarray, np.ndarray]:
    """The case's ``(x, y)`` pairs, broadcast and flattened."""
    x, y = np.broadcast_arrays(data.x, data.y)
    return x.ravel(), y.ravel()


def _regions(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """0 below, 1 inside, 2 above (NaN gets 1 but is excluded separately)."""
    with np.errstate(invalid="ignore"):
        return np.where(values < low, 0, np.where(values > high, 2, 1))


@pytest.mark.parametrize("chunk_size", [7, 2**22], ids=["chunked", "one-chunk"])
def test_histogram2d_matches_numpy(data_2d, chunk_size):
    hist = _histogram2d_of(data_2d, chunk_size=chunk_size)
    x, y = _flat_pairs(data_2d)
    expected, x_edges, y_edges = np.histogram2d(
        x, y, bins=data_2d.bins, range=(data_2d.x_range, data_2d.y_range)
    )
    np.testing.assert_array_equal(hist.counts.numpy(), expected, err_msg="counts")
    np.testing.assert_array_equal(hist.x_edges.numpy(), x_edges, err_msg="x_edges")
    np.testing.assert_array_equal(hist.y_edges.numpy(), y_edges, err_msg="y_edges")
    nan = np.isnan(x) | np.isnan(y)
    assert hist.nan.item() == int(nan.sum())
    rx, ry = _regions(x, *data_2d.x_range)[~nan], _regions(y, *data_2d.y_range)[~nan]
    margins = np.zeros((3, 3), dtype=np.int64)
    np.add.at(margins, (rx, ry), 1)
    np.testing.assert_array_equal(hist.margins.numpy(), margins, err_msg="margins")
    assert hist.margins[1, 1].item() == hist.counts.sum().item()
    assert hist.margins.sum().item() + hist.nan.item() == x.size


@pytest.mark.parametrize("chunk_size", [7, 2**22], ids=["chunked", "one-chunk"])
def test_histogram2d_clamp_matches_numpy_of_clipped_pairs(data_2d, chunk_size):
    """Cockpit's semantics: each coordinate is clamped into its range."""
    hist = _histogram2d_of(data_2d, out_of_range="clamp", chunk_size=chunk_size)
    counted = _histogram2d_of(data_2d)
    x, y = _flat_pairs(data_2d)
    nan = np.isnan(x) | np.isnan(y)
    expected, x_edges, y_edges = np.histogram2d(
        np.clip(x[~nan], *data_2d.x_range),
        np.clip(y[~nan], *data_2d.y_range),
        bins=data_2d.bins,
        range=(data_2d.x_range, data_2d.y_range),
    )
    np.testing.assert_array_equal(hist.counts.numpy(), expected, err_msg="counts")
    np.testing.assert_array_equal(hist.x_edges.numpy(), x_edges, err_msg="x_edges")
    np.testing.assert_array_equal(hist.y_edges.numpy(), y_edges, err_msg="y_edges")
    assert torch.equal(hist.margins, counted.margins), "margins: where pairs were"
    assert hist.nan.item() == int(nan.sum())
    assert (hist.counts.sum() + hist.nan).item() == x.size


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda v: histogram1d(v, 1.0, 1.0, 3), ValueError, "low < high"),
        (lambda v: histogram1d(v, 0.0, np.inf, 3), ValueError, "finite"),
        (lambda v: histogram1d(v, 0.0, 1.0, 0), ValueError, "bins must be"),
        (lambda v: histogram1d(v.long(), 0.0, 1.0, 3), TypeError, "floating-point"),
        (lambda v: histogram1d(v, 1.0, 1.0 + 1e-15, 64), ValueError, "too narrow"),
        (lambda v: histogram1d(v, 0.0, 1.0, 3, chunk_size=0), ValueError, "chunk"),
        (
            lambda v: histogram2d(v, v[:2], (0, 1), (0, 1), (2, 2)),
            ValueError,
            "broadcast",
        ),
        (lambda v: histogram2d(v, v, (0, 1), (0, 1), (2,)), ValueError, "pair"),
        (
            lambda v: histogram1d(v, 0.0, 1.0, 3, out_of_range="clip"),
            ValueError,
            "out_of_range",
        ),
        (
            lambda v: histogram2d(v, v, (0, 1), (0, 1), (2, 2), out_of_range="drop"),
            ValueError,
            "out_of_range",
        ),
    ],
    ids=[
        "empty-range",
        "infinite-range",
        "zero-bins",
        "integer-data",
        "narrow-range",
        "zero-chunk",
        "no-broadcast",
        "bins-not-pair",
        "unknown-out-of-range",
        "unknown-out-of-range-2d",
    ],
)
def test_bad_input_raises(call, error, message):
    with pytest.raises(error, match=message):
        call(torch.zeros(3, dtype=torch.float64))


def test_pairs_outside_count_every_region_but_the_centre():
    """Clamped pairs sit in the edge bins; only the margins say they were outside."""
    margins = np.array([[1, 2, 0], [3, 50, 4], [0, 5, 6]])
    assert pairs_outside(margins) == 21
    assert pairs_outside(torch.tensor(margins)) == 21
