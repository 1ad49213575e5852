"""``RunResult``: the one place that writes and reads ``result.json``."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.measure import MemoryReading
from benchmarks.sweep.result import RESULT_FILE, FinalMetrics, RunResult, StepTime
from benchmarks.sweep.training import Curves


def trained() -> RunResult:
    return RunResult(
        problem="p",
        optimizer="sgd",
        seed=1,
        status="ok",
        grid_point={"lr": 0.1},
        hyperparameters={"lr": 0.1},
        metric="accuracy",
        maximize=True,
        targets=[0.5, 0.9],
        curves=Curves([0, 4], [0.0, 0.1], [2.0, 1.0], [2.1, math.nan], [0.1, 0.6]),
        final=FinalMetrics(1.0, 1.1, 0.6),
        best_test_metric=0.6,
        steps_to_target=[4, None],
        time_to_target=[0.1, None],
        steps_taken=4,
        train_time=0.1,
        step_time=StepTime(0.02, 2),
        memory=MemoryReading("cpu_job_peak_rss", 12.0, 10.0),
        device="cpu",
        config={"extended_from": {"key": "lr", "edge": "max"}},
    )


def test_round_trip_through_result_json(tmp_path):
    original = trained()
    path = original.write(tmp_path / "0")
    assert path == tmp_path / "0" / RESULT_FILE
    assert original.result_file == path.resolve()
    data = json.loads(path.read_text())
    assert data["best"] == {"test_metric": 0.6} and data["diverged"] is False
    assert data["curves"]["test_loss"] == [2.1, None], "non-finite floats are null"
    assert "job_dir" not in data
    loaded = RunResult.read(path)
    assert loaded.job_dir == str(tmp_path / "0")
    assert loaded.curves.test_loss == [2.1, None]
    loaded.curves.test_loss = original.curves.test_loss
    assert loaded.to_json() == original.to_json()
    assert loaded.extended_from == {"key": "lr", "edge": "max"}


def test_failed_record_has_no_training_fields():
    failed = RunResult("p", "sgd", 0, error="ValueError: lr")
    assert failed.status == "failed" and not failed.trained and not failed.diverged
    assert RunResult.from_json(failed.to_json()) == failed
    with pytest.raises(ValueError, match="neither read from nor written"):
        _ = failed.result_file


def test_unknown_status_is_an_error():
    with pytest.raises(ValueError, match="status must be one of"):
        RunResult("p", "sgd", 0, status="done")


@pytest.mark.parametrize(
    ("divergence", "at_chance_level"),
    [
        ("final test accuracy 0.1 ≤ 0.19 (chance 1/10 + 0.1 of the gap to 1)", True),
        ("train loss 12 > 10 × initial 1 at step 30", False),
        (None, False),
    ],
)
def test_a_result_written_before_the_chance_flag_reads_it_from_the_reason(
    divergence, at_chance_level
):
    data = RunResult("digits_mlp", "sgd", 0, status="ok").to_json()
    del data["at_chance_level"]
    data["divergence"] = divergence
    assert RunResult.from_json(data).at_chance_level is at_chance_level
