"""Diagnostic specs: defaults, validation, pickling."""

from __future__ import annotations

import math
import pickle

import pytest

from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DecadeSchedule,
    GradientHistogram,
    GradientParameterHistogram,
    LogSpacedSchedule,
    NoiseScale,
    PercentileRange,
)

SPECS = [
    GSNR(schedule=DecadeSchedule(), epsilon=1e-6),
    NoiseScale(schedule=LogSpacedSchedule(100, num=5)),
    GradientHistogram(bins=30, range_policy=PercentileRange(), initial_range=(-2, 2)),
    GradientParameterHistogram(bins=[8, 9], parameter_range=PercentileRange()),
    GradientHistogram(semantics="cockpit"),
    CurvatureTrace(curvature="diag_ggn_mc", mc_samples=4),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: type(spec).__name__)
def test_specs_pickle(spec):
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_defaults_and_normalization():
    assert CurvatureTrace().label == "diag_ggn_exact"
    assert CurvatureTrace(curvature="diag_h", label="hessian").label == "hessian"
    assert GradientParameterHistogram(bins=[8, 9]).bins == (8, 9)
    assert GradientHistogram(initial_range=(-2, 2)).initial_range == (-2.0, 2.0)
    assert GSNR().schedule(0) and GSNR().schedule(17)
    assert GradientHistogram().semantics == "dampednewton"
    assert GradientParameterHistogram().semantics == "dampednewton"


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: GSNR(epsilon=-1.0), ValueError, "epsilon"),
        (lambda: GSNR(label="a/b"), ValueError, "without '/'"),
        (lambda: NoiseScale(label=""), ValueError, "non-empty"),
        (lambda: NoiseScale(schedule=3), TypeError, "callable"),
        (lambda: GradientHistogram(bins=0), ValueError, "bins"),
        (lambda: GradientHistogram(range_policy=(-1, 1)), TypeError, "compute"),
        (lambda: GradientHistogram(initial_range=(1, -1)), ValueError, "low < high"),
        (lambda: GradientParameterHistogram(bins=(3,)), ValueError, "pair"),
        (lambda: GradientParameterHistogram(bins=20), ValueError, "pair of integers"),
        (
            lambda: GradientHistogram(initial_range=(0.0, math.inf)),
            ValueError,
            r"initial_range must be \(low, high\), finite",
        ),
        (lambda: GradientParameterHistogram(bins=(3, 0)), ValueError, "bins"),
        (
            lambda: GradientParameterHistogram(parameter_range="max"),
            TypeError,
            "compute",
        ),
        (lambda: CurvatureTrace(curvature="kfac"), ValueError, "Unknown curvature"),
        (lambda: CurvatureTrace(mc_samples=0), ValueError, "mc_samples"),
        (lambda: GradientHistogram(semantics="numpy"), ValueError, "semantics"),
        (
            lambda: GradientParameterHistogram(semantics="Cockpit"),
            ValueError,
            "semantics",
        ),
    ],
    ids=[
        "negative-epsilon",
        "slash-label",
        "empty-label",
        "schedule-not-callable",
        "zero-bins",
        "range-not-policy",
        "initial-range-reversed",
        "bins-not-pair",
        "bins-a-number-2d",
        "initial-range-infinite",
        "zero-bins-2d",
        "parameter-range-not-policy",
        "unknown-curvature",
        "zero-mc-samples",
        "unknown-semantics",
        "unknown-semantics-2d",
    ],
)
def test_bad_specs_raise(make, error, message):
    with pytest.raises(error, match=message):
        make()
