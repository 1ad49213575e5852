"""The sweep's time estimate: cost priors per kind of job, refined by finished jobs."""

from __future__ import annotations

import pytest

from benchmarks.sweep.eta import (
    JOB_OVERHEAD_SECONDS,
    format_duration,
    job_kind,
    prior_seconds,
    remaining_seconds,
)

SGD, DN = ("optimizer=sgd",), ("optimizer=dampednewton",)


def test_before_any_job_the_estimate_is_the_sum_of_priors():
    prior = {SGD: 0.5, DN: 2.0}
    assert remaining_seconds([SGD] * 3 + [DN] * 2, {}, prior) == 3 * 0.5 + 2 * 2.0


def test_the_slow_jobs_last_are_not_estimated_at_the_rate_of_the_fast_ones():
    """The issue's sweep: 24 fast jobs done in 0.5 s each, 12 jobs 12× as costly left.

    A rate over the finished jobs predicts 12 · 0.5 s = 6 s; the priors say each
    pending job costs 12 × a fast one, and the fast ones ran at their prior speed.
    """
    prior = {SGD: 0.5, DN: 6.0}
    estimate = remaining_seconds([DN] * 12, {SGD: [0.5] * 24}, prior)
    assert estimate == pytest.approx(12 * 6.0, rel=1e-15)


def test_a_kind_without_finished_jobs_is_scaled_by_the_machine_speed():
    """Finished jobs took 3× their priors: the unseen kind's prior is tripled."""
    prior = {SGD: 0.5, ("optimizer=adam",): 0.6, DN: 2.0}
    durations = {SGD: [1.2, 1.8], ("optimizer=adam",): [1.8]}
    # spent 4.8 s against a prior of 2 · 0.5 + 0.6 = 1.6 s: speed 3
    estimate = remaining_seconds([SGD, DN, DN], durations, prior)
    assert estimate == pytest.approx(1.5 + 2 * 2.0 * 3.0, rel=1e-15)


def test_a_kind_with_finished_jobs_takes_their_mean_not_its_prior():
    prior = {SGD: 0.5, DN: 2.0}
    durations = {SGD: [0.4, 0.6], DN: [10.0, 14.0]}
    assert remaining_seconds([DN, DN, SGD], durations, prior) == pytest.approx(
        2 * 12.0 + 0.5, rel=1e-15
    )
    assert remaining_seconds([], durations, prior) == 0


def test_job_kind_drops_only_the_cost_neutral_overrides():
    job = ["+sweep=default", "optimizer=adam", "grid_point=3", "seed=2", "x.seed=1"]
    assert job_kind(job) == ("+sweep=default", "optimizer=adam", "x.seed=1")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0 s"), (44.6, "45 s"), (200, "3 min 20 s"), (3900, "1 h 05 min")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_every_optimizer_has_a_step_cost_prior(compose_config, optimizer_name):
    cfg = compose_config([f"optimizer={optimizer_name}"])
    assert cfg.step_cost_prior >= 1.0, "no optimizer steps faster than SGD"


def test_every_problem_prior_follows_the_formula(compose_config, problem_name):
    cfg = compose_config([f"problem={problem_name}", "optimizer=dampednewton"])
    problem = cfg.problem
    assert problem.cost_prior.sgd_step > 0 and problem.cost_prior.evaluation > 0
    evaluations = problem.steps // problem.eval_every + 1
    expected = (
        JOB_OVERHEAD_SECONDS
        + evaluations * problem.cost_prior.evaluation
        + problem.steps * problem.cost_prior.sgd_step * cfg.step_cost_prior
    )
    assert prior_seconds(cfg) == pytest.approx(expected, rel=1e-15)


def test_damped_newton_is_priced_above_sgd_on_the_default_problem(compose_config):
    sgd = prior_seconds(compose_config(["optimizer=sgd"]))
    damped_newton = prior_seconds(compose_config(["optimizer=dampednewton"]))
    # Its step_cost_prior (amortized refreshes) is 4× SGD's; evaluations cost both.
    assert damped_newton > sgd
