"""The jobs' learning-rate schedules (linear, inverse square root) as LambdaLR."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.measure import Stopwatch
from benchmarks.problems.data import Dataset
from benchmarks.problems.models import mlp
from benchmarks.problems.problems import Problem, Protocol
from benchmarks.sweep.job import run_job
from benchmarks.sweep.result import RESULT_FILE
from benchmarks.sweep.schedules import InverseSqrtDecay, LinearDecay, lr_scheduler
from benchmarks.sweep.training import OptimizerNeeds, mini_batches, train

STEPS = 5
LR = 0.3
HORIZON = 50.0


def _problem() -> Problem:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=gen)
    return Problem(
        "tiny",
        mlp(5, [4], 3, generator=gen).double(),
        torch.nn.CrossEntropyLoss(),
        Dataset(x, y, x, y),
        Protocol("accuracy", (), batch_size=4, steps=STEPS, eval_every=STEPS),
    )


def _batches():
    return mini_batches(12, 4, torch.Generator().manual_seed(1), torch.device("cpu"))


def test_linear_decay_factors():
    decay = LinearDecay(4)
    assert [decay(step) for step in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_inverse_sqrt_decay_factors():
    decay = InverseSqrtDecay(50.0)
    factors = [decay(step) for step in (0, 50, 150, 2400)]
    assert factors == pytest.approx([1.0, 2**-0.5, 0.5, 1 / 7], rel=1e-15)


def test_training_with_the_linear_schedule_is_sgd_at_hand_decayed_rates():
    problem = _problem()
    reference = _problem()  # the same initialization and data
    optimizer = torch.optim.SGD(problem.model.parameters(), lr=LR)
    scheduler = lr_scheduler("linear", optimizer, STEPS, HORIZON)
    train(
        problem,
        optimizer,
        OptimizerNeeds(),
        _batches(),
        Stopwatch(torch.device("cpu")),
        scheduler=scheduler,
    )

    by_hand = torch.optim.SGD(reference.model.parameters(), lr=LR)
    batches = _batches()
    for step in range(STEPS):
        index = next(batches)
        by_hand.param_groups[0]["lr"] = LR * (1 - step / STEPS)
        by_hand.zero_grad()
        x, y = reference.data.x_train[index], reference.data.y_train[index]
        reference.loss_fn(reference.model(x), y).backward()
        by_hand.step()
    for trained, expected in zip(
        problem.model.parameters(), reference.model.parameters(), strict=True
    ):
        torch.testing.assert_close(trained, expected, rtol=1e-14, atol=1e-15)
    assert optimizer.param_groups[0]["lr"] == 0.0
    assert optimizer.param_groups[0]["initial_lr"] == LR


def test_an_unknown_schedule_is_refused():
    optimizer = torch.optim.SGD(_problem().model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"lr_schedule must be null .* linear"):
        lr_scheduler("cosine", optimizer, STEPS, HORIZON)
    with pytest.raises(ValueError, match="lr_schedule_horizon must be > 0"):
        lr_scheduler("inverse_sqrt", optimizer, STEPS, 0.0)
    assert lr_scheduler(None, optimizer, STEPS, HORIZON) is None


def _dampednewton_job(compose_config, tmp_path, *overrides):
    cfg = compose_config(
        [
            "device=cpu",
            "problem=digits_mlp",
            "optimizer=dampednewton",
            "problem.steps=2",
            "problem.eval_every=1",
            "seed=2",
            *overrides,
        ]
    )
    run_job(cfg, tmp_path)
    with open(tmp_path / RESULT_FILE) as f:
        return json.load(f)


def test_a_dampednewton_job_takes_the_schedule_from_its_second_step(
    compose_config, tmp_path
):
    """``LambdaLR`` on DampedNewton's groups: step 1 at the full rate, 2 at half."""
    constant = _dampednewton_job(compose_config, tmp_path / "constant")
    decayed = _dampednewton_job(
        compose_config, tmp_path / "decayed", "lr_schedule=linear"
    )
    assert constant["status"] == decayed["status"] == "ok"
    assert decayed["hyperparameters"]["lr_schedule"] == "linear"
    assert "lr_schedule" not in constant["hyperparameters"]
    assert decayed["curves"]["step"] == constant["curves"]["step"] == [0, 1, 2]
    losses = decayed["curves"]["train_loss"], constant["curves"]["train_loss"]
    assert losses[0][:2] == losses[1][:2]  # the same first step
    assert losses[0][2] != losses[1][2]  # the second at half the learning rate


def test_an_inverse_sqrt_job_decays_by_its_horizon(compose_config, tmp_path):
    """Step 1 at the full rate whatever the horizon, step 2 at ``(1 + 1/h)^(-1/2)``."""
    short, long = (
        _dampednewton_job(
            compose_config,
            tmp_path / f"horizon{horizon}",
            "lr_schedule=inverse_sqrt",
            f"lr_schedule_horizon={horizon}",
        )
        for horizon in (1, 1000)
    )
    assert short["status"] == long["status"] == "ok"
    assert short["hyperparameters"]["lr_schedule"] == "inverse_sqrt"
    assert short["hyperparameters"]["lr_schedule_horizon"] == 1
    assert long["hyperparameters"]["lr_schedule_horizon"] == 1000
    losses = short["curves"]["train_loss"], long["curves"]["train_loss"]
    assert losses[0][:2] == losses[1][:2]
    assert losses[0][2] != losses[1][2]
