"""Schedules: tracked steps, validation, pickling."""

from __future__ import annotations

import pickle

import pytest

from dampednewton.diagnostics.schedules import (
    DecadeSchedule,
    EveryKSteps,
    LogSpacedSchedule,
    Schedule,
)

CASES = [
    ("every-step", EveryKSteps(), 6, [0, 1, 2, 3, 4, 5]),
    ("every-3-from-2-to-11", EveryKSteps(3, start=2, stop=11), 20, [2, 5, 8, 11]),
    (
        "decades",
        DecadeSchedule(),
        1001,
        [*range(10), *range(10, 100, 10), *range(100, 1000, 100), 1000],
    ),
    (
        "decades-1-2-5",
        DecadeSchedule((1, 2, 5)),
        600,
        [0, 1, 2, 5, 10, 20, 50, 100, 200, 500],
    ),
    ("log-spaced-4", LogSpacedSchedule(1000, num=4), 2000, [0, 1, 10, 100, 1000]),
    (
        "log-spaced-dense-start",
        LogSpacedSchedule(100, num=7),
        200,
        [0, 1, 2, 5, 10, 22, 46, 100],
    ),
]


@pytest.mark.parametrize(
    ("schedule", "horizon", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_tracked_steps(schedule, horizon, expected):
    assert isinstance(schedule, Schedule)
    assert [step for step in range(horizon) if schedule(step)] == expected


@pytest.mark.parametrize(
    "schedule", [case[1] for case in CASES], ids=[case[0] for case in CASES]
)
def test_schedules_pickle(schedule):
    restored = pickle.loads(pickle.dumps(schedule))
    assert restored == schedule
    assert [restored(s) for s in range(50)] == [schedule(s) for s in range(50)]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: EveryKSteps(0), "k must be"),
        (lambda: EveryKSteps(1, start=-1), "start must be"),
        (lambda: EveryKSteps(1, start=5, stop=4), "stop"),
        (lambda: DecadeSchedule((1, 10)), "1..9"),
        (lambda: DecadeSchedule((2, 2)), "distinct"),
        (lambda: DecadeSchedule(()), "distinct"),
        (lambda: LogSpacedSchedule(0), "max_step"),
        (lambda: LogSpacedSchedule(10, num=1), "num"),
        (lambda: EveryKSteps()(-1), "step must be"),
        (lambda: DecadeSchedule()(1.5), "step must be"),
    ],
    ids=[
        "k-zero",
        "negative-start",
        "stop-before-start",
        "multiplier-10",
        "repeated-multiplier",
        "no-multiplier",
        "max-step-zero",
        "num-one",
        "negative-step",
        "float-step",
    ],
)
def test_bad_input_raises(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: EveryKSteps(2.5),
        lambda: EveryKSteps(2, start=1.0),
        lambda: EveryKSteps(2, stop="10"),
    ],
    ids=["float-k", "float-start", "string-stop"],
)
def test_every_k_steps_needs_integers(make):
    with pytest.raises(TypeError, match="must be an integer"):
        make()
