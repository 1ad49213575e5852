"""The report's tables on hand-made results (fields of run_job)."""

from __future__ import annotations

from benchmarks.report.aggregate import group_settings, tune
from benchmarks.report.report import problem_table
from benchmarks.report.trade_off import trade_off
from benchmarks.sweep.result import RunResult
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


def _run_of(optimizer: str, status: str, final: float | None = None) -> RunResult:
    """A run on problem ``q`` (a loss, lower is better); a failed one records less."""
    record = {
        "problem": "q",
        "optimizer": optimizer,
        "seed": 0,
        "status": status,
        "config": {"problem": {"steps": 20, "batch_size": 128, "eval_every": 10}},
    }
    if status == "ok":
        record.update(
            hyperparameters={"lr": 0.01},
            maximize=False,
            metric="loss",
            targets=[400.0, 87.0],
            final={"test_metric": final, "test_loss": final, "train_loss": final},
            best={"test_metric": final},
            steps_to_target=[10, 20],
            time_to_target=[0.01, 0.02],
            step_time={"median": 0.001},
        )
    else:
        record["error"] = "ValueError: Muon needs a hidden weight matrix"
    return RunResult.from_json(record)


def test_a_failed_first_optimizer_leaves_the_metric_and_targets_to_the_others():
    """Muon failed on the model: the table still names the loss and the targets."""
    runs = [_run_of("muon", "failed"), _run_of("sgd", "ok", 80.0)]
    runs.append(_run_of("dampednewton", "ok", 90.0))
    settings = group_settings(runs)
    tuned = {optimizer: t for (_, optimizer), t in tune(settings).items()}
    assert next(iter(tuned)) == "muon"
    table = problem_table("q", tuned, settings)
    assert "Test metric: loss (lower is better), targets 400, 87" in table
    assert "| steps to 87 | time to 87 [s] |" in table
    assert "reached test loss 87 in 20 steps" in trade_off("q", tuned, settings)
