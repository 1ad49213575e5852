"""The report's trade-off paragraph on hand-made results (fields of run_job)."""

from __future__ import annotations

from benchmarks.aggregate import group_settings, tune
from benchmarks.result import RunResult
from benchmarks.trade_off import trade_off


def result(optimizer, seed, final, steps, seconds, step_time, lr=1.0):
    """A trained run on problem ``p`` with targets 0.5 and 0.9 (accuracy)."""
    return RunResult.from_json(
        {
            "problem": "p",
            "optimizer": optimizer,
            "seed": seed,
            "status": "ok",
            "hyperparameters": {"lr": lr},
            "maximize": True,
            "metric": "accuracy",
            "targets": [0.5, 0.9],
            "final": {"test_metric": final},
            "steps_to_target": steps,
            "time_to_target": seconds,
            "step_time": {"median": step_time},
        }
    )


def paragraph(runs):
    settings = group_settings(runs)
    tuned = {optimizer: t for (_, optimizer), t in tune(settings).items()}
    return trade_off("p", tuned, settings)


def test_fewer_steps_but_costlier_steps_are_both_stated_with_their_numbers():
    runs = [result("sgd", s, 0.91, [30, 60], [0.3, 0.6], 0.01) for s in range(2)] + [
        result("adam", s, 0.92, [20, 90], [0.3, 1.5], 0.015) for s in range(2)
    ]
    runs += [
        result("dampednewton", s, final, [10, 20], [1.0, 2.0], 0.1)
        for s, final in enumerate((0.94, 0.96))
    ]
    runs += [  # a worse setting: the tuned one is stated
        result("dampednewton", s, 0.7, [15, None], [1.5, None], 0.1, lr=0.1)
        for s in range(2)
    ]
    text = paragraph(runs)
    # the harder target (0.9): ours in 20 steps, sgd the fewest of the others (60)
    assert "dampednewton (lr=1) reached test accuracy 0.9 in 20 steps" in text
    assert "sgd (the fewest steps among the others) in 60 steps: 3× fewer steps" in (
        text
    )
    assert "One dampednewton step costs 10× one sgd step" in text
    assert "it got there 3.3× later (2 s against 0.6 s)" in text
    assert "Final test accuracy: 0.95 against 0.92 for adam" in text


def test_no_target_reached_says_so_with_the_step_cost():
    runs = [result("sgd", 0, 0.95, [30, 60], [0.3, 0.6], 0.01)]
    runs += [result("dampednewton", 0, 0.4, [None, None], [None, None], 0.05)]
    text = paragraph(runs)
    assert "reached no target (0.5, 0.9) on any seed" in text
    assert "one step costs 5× one sgd step" in text
    assert "Final test accuracy: 0.4 against 0.95 for sgd" in text


def test_a_target_only_ours_reached():
    runs = [result("sgd", 0, 0.6, [30, None], [0.3, None], 0.01)]
    runs += [result("dampednewton", 0, 0.95, [10, 40], [0.5, 2.0], 0.05)]
    text = paragraph(runs)
    assert "On p, dampednewton reached test accuracy 0.9 in 40 steps (2 s of" in text
    assert "no other optimizer reached it" in text


def test_seeds_that_missed_the_target_are_counted():
    runs = [result("sgd", s, 0.95, [30, 60], [0.3, 0.6], 0.01) for s in range(2)]
    runs += [
        result("dampednewton", 0, 0.95, [10, 20], [0.5, 1.0], 0.05),
        result("dampednewton", 1, 0.85, [12, None], [0.6, None], 0.05),
    ]
    assert "in 20 steps (1/2 seeds)" in paragraph(runs)


def test_no_paragraph_without_the_package_or_without_a_rival():
    assert paragraph([result("sgd", 0, 0.9, [1, 2], [0.1, 0.2], 0.01)]) is None
    ours = [result("dampednewton", 0, 0.9, [1, 2], [0.1, 0.2], 0.01)]
    assert paragraph(ours) is None
