"""The report's trade-off paragraph on hand-made results (fields of run_job)."""

from __future__ import annotations

from benchmarks.report.aggregate import group_settings, tune
from benchmarks.report.trade_off import trade_off
from tests.benchmarks.made_results import made_result


def result(optimizer, seed, final, steps, seconds, step_time, lr=1.0):
    """A trained run on problem ``p`` with targets 0.5 and 0.9 (accuracy)."""
    return made_result(
        optimizer, seed, steps, seconds=seconds, final=final, step_time=step_time, lr=lr
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
    runs += [  # a worse setting, slower to the target: the fastest grid point counts
        result("dampednewton", s, 0.7, [15, 40], [1.5, 4.0], 0.1, lr=0.1)
        for s in range(2)
    ]
    text = paragraph(runs)
    # the harder target (0.9): ours in 20 steps, sgd the fewest and soonest of the
    # others (60 steps, 0.6 s)
    assert (
        "On p, dampednewton reached test accuracy 0.9 in 20 steps (lr=1) and 2 s of "
        "training (lr=1)" in text
    )
    assert (
        "Fewest steps among the others: sgd, 60 steps: dampednewton took 3× fewer"
        in (text)
    )
    assert (
        "Least time among the others: sgd, 0.6 s: dampednewton got there 3.3× later"
        in (text)
    )
    assert "One dampednewton step costs 10× one sgd step." in text
    assert (
        "Every other optimizer, by time: sgd 60 steps, 0.6 s; adam 90 steps, 1.5 s"
        in (text)
    )
    assert (
        "Final test accuracy: 0.95 (dampednewton tuned) against 0.92 for adam" in text
    )


def test_fewest_steps_and_least_time_may_be_two_optimizers_peers_included():
    # soap takes the fewest steps but costly ones; momentum gets there soonest
    runs = [result("momentum", s, 0.9, [40, 80], [0.2, 0.4], 0.005) for s in range(3)]
    runs += [result("soap", s, 0.93, [20, 40], [0.4, 0.8], 0.02) for s in range(3)]
    runs += [
        result("dampednewton", s, 0.95, [10, 30], [1.0, 3.0], 0.1) for s in range(3)
    ]
    text = paragraph(runs)
    assert (
        "Fewest steps among the others: soap, 40 steps: dampednewton took 1.3× fewer"
        in (text)
    )
    assert (
        "Least time among the others: momentum, 0.4 s: dampednewton got there 7.5×"
        in (text)
    )
    assert (
        "One dampednewton step costs 5× one soap step and 20× one momentum step."
        in (text)
    )
    assert "by time: momentum 80 steps, 0.4 s; soap 40 steps, 0.8 s." in text


def test_each_seed_takes_its_fastest_grid_point_and_the_median_seed_counts():
    # AlgoPerf's rule: seed 0's fastest is lr=0.1 (50 steps), seed 1's and seed 2's are
    # lr=1 (70, 90): the median over seeds is 70 steps, at lr=1
    runs = [
        result("sgd", 0, 0.9, [10, 50], [0.1, 0.5], 0.01, lr=0.1),
        result("sgd", 1, 0.9, [10, 95], [0.1, 0.95], 0.01, lr=0.1),
        result("sgd", 2, 0.9, [10, None], [0.1, None], 0.01, lr=0.1),
        result("sgd", 0, 0.9, [10, 60], [0.1, 0.6], 0.01),
        result("sgd", 1, 0.9, [10, 70], [0.1, 0.7], 0.01),
        result("sgd", 2, 0.9, [10, 90], [0.1, 0.9], 0.01),
    ]
    runs += [
        result("dampednewton", s, 0.95, [5, 20], [0.5, 2.0], 0.1) for s in range(3)
    ]
    text = paragraph(runs)
    assert "Fewest steps among the others: sgd, 70 steps (lr=1):" in text


def test_a_target_most_seeds_missed_is_not_reached():
    runs = [result("sgd", s, 0.95, [30, 60], [0.3, 0.6], 0.01) for s in range(3)]
    runs += [
        result("dampednewton", 0, 0.95, [10, 20], [0.5, 1.0], 0.05),
        result("dampednewton", 1, 0.85, [12, None], [0.6, None], 0.05),
        result("dampednewton", 2, 0.85, [12, None], [0.6, None], 0.05),
    ]
    text = paragraph(runs)
    assert "reached test accuracy 0.5 in 12 steps and 0.6 s" in text  # the easier one
    runs[-1] = result("dampednewton", 2, 0.95, [12, 30], [0.6, 1.5], 0.05)
    assert "reached test accuracy 0.9 in 30 steps (2/3 seeds) and 1.5 s" in (
        paragraph(runs)
    )


def test_no_target_reached_says_so_with_the_step_cost():
    runs = [result("sgd", 0, 0.95, [30, 60], [0.3, 0.6], 0.01)]
    runs += [result("dampednewton", 0, 0.4, [None, None], [None, None], 0.05)]
    text = paragraph(runs)
    assert "reached no target (0.5, 0.9) on the median seed" in text
    assert "one step costs 5× one sgd step" in text
    assert "Final test accuracy: 0.4 (dampednewton tuned) against 0.95 for sgd" in text


def test_a_target_only_ours_reached():
    runs = [result("sgd", 0, 0.6, [30, None], [0.3, None], 0.01)]
    runs += [result("dampednewton", 0, 0.95, [10, 40], [0.5, 2.0], 0.05)]
    text = paragraph(runs)
    assert "On p, dampednewton reached test accuracy 0.9 in 40 steps and 2 s of" in text
    assert "no other optimizer reached it" in text


def test_an_optimizer_that_missed_the_target_is_listed_last():
    runs = [result("sgd", 0, 0.95, [30, 60], [0.3, 0.6], 0.01)]
    runs += [result("kron", 0, 0.6, [30, None], [0.3, None], 0.2)]
    runs += [result("dampednewton", 0, 0.95, [10, 40], [0.5, 2.0], 0.05)]
    assert "by time: sgd 60 steps, 0.6 s; kron not reached (0/1 seeds)." in (
        paragraph(runs)
    )


def test_no_paragraph_without_the_package_or_without_a_rival():
    assert paragraph([result("sgd", 0, 0.9, [1, 2], [0.1, 0.2], 0.01)]) is None
    ours = [result("dampednewton", 0, 0.9, [1, 2], [0.1, 0.2], 0.01)]
    assert paragraph(ours) is None


def test_steps_and_time_name_their_own_grid_points():
    # lr=1 takes fewer steps, lr=0.1 cheaper ones: each figure names its grid point
    runs = [result("sgd", 0, 0.9, [30, 60], [0.3, 0.6], 0.01)]
    runs += [result("dampednewton", 0, 0.95, [10, 20], [1.0, 2.0], 0.1)]
    runs += [result("dampednewton", 0, 0.95, [15, 30], [0.5, 1.0], 0.03, lr=0.1)]
    assert "in 20 steps (lr=1) and 1 s of training (lr=0.1)" in paragraph(runs)


def test_a_target_the_initial_model_meets_is_no_division_by_zero():
    """Every optimizer starts a seed from the same model: a loose target at step 0.

    The paragraph compares the hardest target ours had to train for; a target met
    only at step 0 is even, and a rival's 0 against ours is infinitely fewer.
    """
    sgd = [result("sgd", s, 0.9, [0, 60], [0.0, 0.6], 0.01) for s in range(3)]
    trained = [
        result("dampednewton", s, 0.95, [0, 20], [0.0, 2.0], 0.1) for s in (0, 1, 2)
    ]
    text = paragraph(sgd + trained)
    assert "reached test accuracy 0.9 in 20 steps" in text
    assert "took 3× fewer steps" in text

    at_start = [
        result("dampednewton", s, 0.95, [0, None], [0.0, None], 0.1) for s in (0, 1, 2)
    ]
    text = paragraph(sgd + at_start)
    assert "reached test accuracy 0.5 in 0 steps" in text
    assert "took as many steps" in text and "at about the same time" in text

    later = [
        result("dampednewton", s, 0.95, [10, None], [0.1, None], 0.1) for s in (0, 1, 2)
    ]
    text = paragraph(sgd + later)
    assert "took ∞× more steps" in text and "got there ∞× later" in text
