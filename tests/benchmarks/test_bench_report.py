"""The report's tables on hand-made results (fields of run_job)."""

from __future__ import annotations

from benchmarks.report.aggregate import group_settings, tune
from benchmarks.report.report import problem_table
from tests.benchmarks.made_results import made_result


def result(optimizer, seed, steps, lr):
    """A trained run on problem ``p``: accuracy targets 0.5 and 0.9, 10 ms a step."""
    return made_result(optimizer, seed, steps, lr=lr)


def test_table_gives_every_optimizer_its_grids_fastest_run_to_each_target():
    runs = [result("sgd", seed, [20, 60], 0.1) for seed in range(2)]
    runs += [result("soap", seed, [10, None], 0.003) for seed in range(2)]
    runs += [result("soap", seed, [30, 40], 0.01) for seed in range(2)]
    settings = group_settings(runs)
    tuned = {o: t for (_, o), t in tune(settings).items()}
    table = problem_table("p", tuned, settings)
    assert "| optimizer | steps to 0.5 | time to 0.5 [s] | steps to 0.9 |" in table
    assert "| sgd | 20 (2/2) | 0.2 (2/2) | 60 (2/2) | 0.6 (2/2) |" in table
    # soap: lr 0.003 is fastest to 0.5, only lr 0.01 reaches 0.9
    assert (
        "| soap | 10 (lr=0.003, 2/2) | 0.1 (lr=0.003, 2/2) | 40 (lr=0.01, 2/2) | "
        "0.4 (lr=0.01, 2/2) |"
    ) in table
