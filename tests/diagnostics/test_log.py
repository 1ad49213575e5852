"""DiagnosticsLog: JSON/NPZ round trip and series access."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsLog,
    DiagnosticsMonitor,
    GradientHistogram,
    GradientParameterHistogram,
    NoiseScale,
)
from tests.cases import DIAGNOSTICS_PROBLEMS
from tests.utils import build_case, run_monitored_step


@pytest.fixture(scope="module")
def monitored_log() -> DiagnosticsLog:
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor(
        [
            GSNR(),
            NoiseScale(),
            GradientHistogram(bins=6),
            GradientParameterHistogram(bins=(3, 4)),
            CurvatureTrace(curvature="diag_h"),
        ],
        case.model.named_parameters(),
    )
    for step in range(2):
        run_monitored_step(case, monitor, step)
    monitor.log.append(
        {"step": 7, "odd": math.inf, "missing": math.nan, "count": np.int64(3)}
    )
    return monitor.log


def assert_records_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        restored = actual[key]
        assert type(restored) is type(value), key
        if isinstance(value, np.ndarray):
            assert restored.dtype == value.dtype, key
            np.testing.assert_array_equal(restored, value, err_msg=key)
        else:
            assert restored == value or (math.isnan(value) and math.isnan(restored)), (
                key
            )


def test_round_trip(tmp_path, monitored_log):
    json_path, npz_path = monitored_log.save(tmp_path / "runs" / "diagnostics")
    assert json_path.name == "diagnostics.json" and npz_path.name == "diagnostics.npz"
    loaded = DiagnosticsLog.load(tmp_path / "runs" / "diagnostics")
    assert len(loaded) == len(monitored_log) == 3
    for actual, expected in zip(loaded, monitored_log, strict=True):
        assert_records_equal(actual, expected)


def test_series(monitored_log):
    steps, values = monitored_log.series("gsnr/mean")
    np.testing.assert_array_equal(steps, [0, 1])
    np.testing.assert_array_equal(
        values, [monitored_log[0]["gsnr/mean"], monitored_log[1]["gsnr/mean"]]
    )
    assert "grad_hist/counts" in monitored_log.keys()
    with pytest.raises(KeyError, match="No record has the key"):
        monitored_log.series("nope")
    with pytest.raises(TypeError, match="holds arrays"):
        monitored_log.series("grad_hist/counts")


@pytest.mark.parametrize(
    ("record", "error", "message"),
    [
        ({"loss": 1.0}, ValueError, "'step'"),
        ({"step": 0, "name": "text"}, TypeError, "int, a float or a numpy array"),
        ({"step": 0, 3: 1.0}, TypeError, "keys must be strings"),
    ],
    ids=["no-step", "string-value", "int-key"],
)
def test_bad_records_raise(record, error, message):
    with pytest.raises(error, match=message):
        DiagnosticsLog([record])


def test_loading_a_foreign_json_raises(tmp_path):
    (tmp_path / "other.json").write_text('{"records": []}')
    with pytest.raises(ValueError, match="not a diagnostics log"):
        DiagnosticsLog.load(tmp_path / "other")
