"""Training loop and job: batching, evaluation, divergence and failure records."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.problems.data import Dataset
from benchmarks.problems.models import mlp
from benchmarks.problems.problems import Problem, Protocol
from benchmarks.sweep import job as job_module
from benchmarks.sweep.callbacks import summary_line
from benchmarks.sweep.job import hyperparameters, run_job
from benchmarks.sweep.result import RESULT_FILE
from benchmarks.sweep.training import evaluate, mini_batches


def test_mini_batches_cover_each_epoch_once_dropping_the_rest():
    batches = mini_batches(10, 3, torch.Generator().manual_seed(0), torch.device("cpu"))
    for _ in range(2):  # two epochs
        epoch = [next(batches) for _ in range(3)]
        seen = torch.cat(epoch)
        assert all(b.shape == (3,) for b in epoch)
        assert seen.unique().numel() == 9 and seen.max() < 10


def test_evaluate_in_batches_matches_one_pass():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (11,), generator=gen)
    problem = Problem(
        "tiny",
        mlp(5, [4], 3, generator=gen).double(),
        torch.nn.CrossEntropyLoss(),
        Dataset(x, y, x, y),
        Protocol("accuracy", (), batch_size=4, steps=1, eval_every=1),
    )
    loss, accuracy = evaluate(problem, x, y, batch_size=4)
    with torch.no_grad():
        out = problem.model(x)
    expected_loss = torch.nn.functional.cross_entropy(out, y).item()
    expected_accuracy = (out.argmax(1) == y).double().mean().item()
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    assert accuracy == pytest.approx(expected_accuracy, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metric": "f1"}, "problem.metric must be one of"),
        ({"steps": 0}, "problem.steps must be >= 1"),
        ({"train_eval_samples": 0}, "train_eval_samples must be >= 1"),
        ({"blowup_factor": 1.0}, "blowup_factor must be > 1"),
        ({"chance_margin": 1.0}, r"chance_margin must be in \[0, 1\)"),
        ({"targets": (1.0, 2.0)}, "easier to harder .*decreasing"),
    ],
    ids=["metric", "steps", "train_eval_samples", "blowup", "chance", "targets"],
)
def test_protocol_validation(kwargs, message):
    settings = {
        "metric": "loss",
        "targets": (),
        "batch_size": 2,
        "steps": 1,
        "eval_every": 1,
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        Protocol(**settings)


def test_protocol_target_direction():
    accuracy = Protocol("accuracy", (0.8, 0.9), 1, 1, 1)
    assert accuracy.reached(0.9, 0.9) and not accuracy.reached(0.89, 0.9)
    loss = Protocol("loss", (2.0, 1.0), 1, 1, 1)
    assert loss.reached(0.5, 1.0) and not loss.reached(1.5, 1.0)


def _job(compose_config, tmp_path, overrides):
    cfg = compose_config(["device=cpu", *overrides])
    summary = run_job(cfg, tmp_path)
    with open(tmp_path / RESULT_FILE) as f:
        return summary, json.load(f)


def test_successful_job_records_curves_and_targets(compose_config, tmp_path):
    summary, result = _job(
        compose_config,
        tmp_path,
        [
            "problem=digits_logreg",
            "problem.steps=12",
            "problem.eval_every=4",
            "problem.targets=[0.5,0.9]",
            "optimizer.lr=0.5",
            "timing.warmup_steps=2",
        ],
    )
    assert result["status"] == "ok" and summary.status == "ok"
    curves = result["curves"]
    assert curves["step"] == [0, 4, 8, 12]
    assert curves["time"][0] == 0 and curves["time"] == sorted(curves["time"])
    assert result["final"]["test_metric"] == curves["test_metric"][-1]
    assert result["best"]["test_metric"] == max(curves["test_metric"])
    assert result["targets"] == [0.5, 0.9]
    for i, target in enumerate(result["targets"]):
        reached = [
            (s, t)
            for s, t, m in zip(
                curves["step"], curves["time"], curves["test_metric"], strict=True
            )
            if m >= target
        ]
        first = reached[0] if reached else (None, None)
        assert (result["steps_to_target"][i], result["time_to_target"][i]) == first
    assert result["steps_to_target"][0] is not None, "logreg reaches 50% in 12 steps"
    assert result["divergence"] is None and result["diverged"] is False
    assert result["train_time"] >= curves["time"][-1] - 1e-12
    assert result["step_time"]["median"] > 0 and result["steps_taken"] == 12
    assert result["memory"]["kind"] == "cpu_job_peak_rss"
    assert result["memory"]["peak_mb"] >= result["memory"]["at_start_mb"] > 0
    assert result["hyperparameters"] == {"lr": 0.5}
    assert result["config"]["problem"]["name"] == "digits_logreg"


def test_finite_blowup_is_diverged_and_stops_early(compose_config, tmp_path):
    """SGD far above 2/λ_max: the loss explodes (finite) past 10× its initial value."""
    summary, result = _job(
        compose_config,
        tmp_path,
        ["problem=noisy_quadratic", "optimizer.lr=0.02", "problem.steps=30"],
    )
    train_loss = result["curves"]["train_loss"]
    assert result["status"] == "diverged" and result["diverged"] is True
    assert result["divergence"].startswith("train loss ")
    assert "> 10 × initial" in result["divergence"]
    assert all(math.isfinite(v) for v in train_loss), "flagged while still finite"
    assert train_loss[-1] > 10 * train_loss[0] >= max(train_loss[:-1])
    step = result["curves"]["step"][-1]
    assert result["divergence"].endswith(f"at step {step}")
    assert result["steps_taken"] == step < 30
    assert result["final"]["test_metric"] is None
    assert "DIVERGED (train loss" in summary_line(summary)
    assert result["at_chance_level"] is False


def test_non_finite_loss_is_diverged(compose_config, tmp_path):
    _, result = _job(
        compose_config,
        tmp_path,
        [
            "problem=noisy_quadratic",
            "optimizer.lr=10",
            "problem.steps=30",
            "problem.blowup_factor=null",
        ],
    )
    assert result["status"] == "diverged"
    assert result["divergence"].startswith("non-finite ")
    assert result["steps_taken"] < 30


NON_FINITE_RUNS = {
    "dampednewton-refuses": [
        "optimizer=dampednewton",
        "optimizer.lr=1e4",
        "optimizer.kl_clip=null",
        "optimizer.damping=1e-8",
        "optimizer.momentum=0.9",
    ],
    "shampoo-raises": ["optimizer=shampoo", "optimizer.lr=1e38"],
}


@pytest.mark.parametrize(
    "optimizer", NON_FINITE_RUNS.values(), ids=list(NON_FINITE_RUNS)
)
def test_a_non_finite_step_an_optimizer_raises_on_is_diverged(
    compose_config, tmp_path, optimizer
):
    """A result, not a failure.

    DampedNewton refuses a non-finite loss or step; torch-optimizer's Shampoo raises
    decomposing a NaN matrix.
    """
    summary, result = _job(
        compose_config,
        tmp_path,
        [
            "problem=digits_mlp",
            "problem.steps=60",
            "problem.eval_every=1000",
            *optimizer,
        ],
    )
    assert result["status"] == "diverged" and summary.status == "diverged"
    assert result["divergence"].startswith("non-finite mini-batch loss or step")
    assert result["curves"]["step"][0] == 0 and result["steps_taken"] < 60


def test_chance_threshold_is_a_fraction_of_the_gap_to_one():
    protocol = Protocol("accuracy", (), 1, 1, 1, chance_margin=0.15)
    assert protocol.chance_threshold(10) == pytest.approx(0.1 + 0.15 * 0.9)
    assert protocol.chance_threshold(2) == pytest.approx(0.5 + 0.15 * 0.5)
    assert (
        Protocol("accuracy", (), 1, 1, 1, chance_margin=None).chance_threshold(10)
        is None
    )


@pytest.mark.parametrize("margin", [0.15, None], ids=["default", "off"])
def test_chance_level_accuracy_is_diverged(compose_config, tmp_path, margin):
    """A learning rate too small to learn leaves digits_mlp near 10% accuracy."""
    summary, result = _job(
        compose_config,
        tmp_path,
        [
            "optimizer.lr=1e-6",
            "problem.steps=20",
            f"problem.chance_margin={'null' if margin is None else margin}",
        ],
    )
    accuracy = result["curves"]["test_metric"][-1]
    assert accuracy <= 0.235, "the run should not have learned"
    if margin is None:
        assert result["status"] == "ok" and result["divergence"] is None
    else:
        assert result["status"] == "diverged"
        assert result["divergence"] == (
            f"final test accuracy {accuracy:.4g} ≤ 0.235 (chance 1/10 + 0.15 of the "
            "gap to 1)"
        )
        assert result["steps_taken"] == 20, "the chance rule does not stop training"
        assert result["at_chance_level"] is True
        assert "AT CHANCE LEVEL (final test accuracy" in summary_line(summary)


def test_failing_job_is_recorded_not_raised(compose_config, tmp_path):
    summary, result = _job(compose_config, tmp_path, ["optimizer.lr=-1"])
    assert result["status"] == "failed" and summary.status == "failed"
    assert "Invalid learning rate" in result["error"]
    assert "Traceback" in result["traceback"]


def test_hyperparameters_flatten_nested_nodes(compose_config):
    cfg = compose_config(
        ["optimizer=momentum", "+optimizer.extra={a: 1, b: {_target_: x.Y, c: 2}}"]
    )
    assert hyperparameters(cfg.optimizer) == {
        "lr": 0.01,
        "momentum": 0.9,
        "extra.a": 1,
        "extra.b._target_": "x.Y",
        "extra.b.c": 2,
    }


@pytest.mark.parametrize("optimizer", ["soap", "kron", "muon"])
def test_peer_configs_train_through_the_runner(compose_config, tmp_path, optimizer):
    """SOAP, PSGD-Kron and Muon from pytorch-optimizer, as a sweep runs them."""
    summary, result = _job(
        compose_config,
        tmp_path,
        [
            f"optimizer={optimizer}",
            "problem=digits_mlp",
            "problem.steps=20",
            "problem.eval_every=10",
            "optimizer.lr=0.01",
        ],
    )
    assert result["status"] == "ok" and summary.status == "ok", result.get("error")
    assert result["optimizer"] == optimizer
    assert result["hyperparameters"]["lr"] == 0.01
    assert result["steps_taken"] == 20 and result["step_time"]["median"] > 0
    train_loss = result["curves"]["train_loss"]
    assert train_loss[-1] < train_loss[0], f"{optimizer} did not lower the loss"


def test_null_threads_restore_torchs_default_after_a_job_that_set_them(
    compose_config, tmp_path, monkeypatch
):
    """A multirun's jobs share a process: ``num_threads=null`` must undo a ``1``."""
    monkeypatch.setattr(job_module, "DEFAULT_THREADS", 2)  # as on a 2-core machine
    default = torch.get_num_threads()
    try:
        overrides = ["problem=digits_logreg", "problem.steps=2"]
        _, first = _job(compose_config, tmp_path / "1", [*overrides, "num_threads=1"])
        _, second = _job(
            compose_config, tmp_path / "2", [*overrides, "num_threads=null"]
        )
    finally:
        torch.set_num_threads(default)
    assert (first["num_threads"], second["num_threads"]) == (1, 2)
