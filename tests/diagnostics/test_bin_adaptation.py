"""Bin-range policies on hand-made inputs."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from dampednewton.diagnostics.bin_adaptation import (
    FALLBACK_RANGE,
    FixedRange,
    MaxAbsRange,
    PercentileRange,
    max_abs_range,
    percentile_range,
    quantile,
    range_hull,
)
from dampednewton.diagnostics.histogram import histogram1d


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("q", [0.0, 1.0, 25.0, 50.0, 62.5, 99.0, 100.0])
def test_quantile_matches_numpy_percentile_on_finite_values(q):
    values = np.random.default_rng(3).normal(size=101)
    with_junk = np.concatenate([values, [np.nan, np.inf, -np.inf]])
    expected = np.percentile(values, q)
    assert quantile(torch.from_numpy(with_junk), q) == pytest.approx(
        expected, rel=1e-14
    )


def test_max_abs_range_is_symmetric_and_padded():
    values = tensor([0.5, -3.0, 1.0, np.nan, np.inf])
    assert max_abs_range(values, 0.1) == pytest.approx((-3.3, 3.3), rel=1e-15)
    assert max_abs_range(values, 0.0) == (-3.0, 3.0)


@pytest.mark.parametrize(
    "values",
    [[0.0, 0.0, -0.0], [np.nan, np.inf], []],
    ids=["all-zero", "no-finite", "empty"],
)
def test_degenerate_data_fall_back(values):
    assert max_abs_range(tensor(values), 0.1) == FALLBACK_RANGE
    assert percentile_range(tensor(values), 1.0, 99.0, 0.1) == FALLBACK_RANGE


def test_percentile_range_keeps_outliers_visible():
    values = tensor([*range(101), 1e6])  # bulk 0..100 and one outlier
    low, high = percentile_range(values, 0.0, 99.0, padding=0.0)
    assert low == 0.0
    assert high == pytest.approx(np.percentile(values.numpy(), 99.0), rel=1e-14)
    hist = histogram1d(values, low, high, 10)
    assert hist.above.item() == 2  # 100 (just above the 99th percentile) and 1e6
    assert hist.counts.sum().item() == 100
    wide = max_abs_range(values, 0.0)
    assert histogram1d(values, *wide, 10).counts[5].item() == 101, (
        "with the max-abs range the whole bulk collapses into one bin"
    )


def test_percentile_range_padding():
    values = tensor(np.linspace(-1, 3, 401))
    assert percentile_range(values, 25.0, 75.0, 0.5) == pytest.approx(
        (0.0 - 1.0, 2.0 + 1.0), abs=1e-12
    )


def test_zero_width_percentile_range_falls_back_to_max_abs():
    values = tensor([2.0] * 50 + [-7.0])
    assert percentile_range(values, 5.0, 95.0, 0.1) == max_abs_range(values, 0.1)


def test_range_hull():
    assert range_hull([(-1.0, 2.0), (-3.0, 0.5), (0.0, 4.0)]) == (-3.0, 4.0)
    with pytest.raises(ValueError, match="at least one"):
        range_hull([])


def test_policies_compute_their_function():
    values = tensor([-2.0, 0.0, 1.0, 5.0])
    assert FixedRange(-4.0, 4.0).compute(values) == (-4.0, 4.0)
    assert MaxAbsRange(0.2).compute(values) == max_abs_range(values, 0.2)
    assert PercentileRange(10.0, 90.0, 0.0).compute(values) == percentile_range(
        values, 10.0, 90.0, 0.0
    )


@pytest.mark.parametrize(
    "policy",
    [FixedRange(-2.0, 3.0), MaxAbsRange(0.3), PercentileRange(5.0, 95.0, 0.1)],
    ids=["fixed", "max-abs", "percentile"],
)
def test_policies_pickle(policy):
    assert pickle.loads(pickle.dumps(policy)) == policy


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FixedRange(1.0, 1.0), "low < high"),
        (lambda: FixedRange(0.0, np.inf), "finite"),
        (lambda: MaxAbsRange(-0.1), "padding"),
        (lambda: PercentileRange(50.0, 50.0), "lower < upper"),
        (lambda: PercentileRange(-1.0, 50.0), "lower < upper"),
        (lambda: PercentileRange(1.0, 99.0, np.nan), "padding"),
        (lambda: quantile(tensor([1.0]), 101.0), r"\[0, 100\]"),
        (lambda: quantile(tensor([np.nan]), 50.0), "no finite values"),
    ],
    ids=[
        "fixed-empty",
        "fixed-infinite",
        "negative-padding",
        "equal-percentiles",
        "negative-percentile",
        "nan-padding",
        "quantile-out-of-range",
        "quantile-no-finite",
    ],
)
def test_bad_input_raises(make, message):
    with pytest.raises(ValueError, match=message):
        make()
