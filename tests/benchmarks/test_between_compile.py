"""The in-between math benchmark: compiled math agrees, swapped math runs."""

from __future__ import annotations

import pytest
import torch

from benchmarks.micro.between_compile import (
    WARM_STEPS,
    largest_relative_difference,
    math_arguments,
    parameter_difference,
    parameters,
    trained,
)
from dampednewton._step import kronecker
from dampednewton._step.kronecker_group import group_step


@pytest.mark.slow
def test_compiled_math_between_refreshes_matches_eager():
    optimizer, _, _ = trained("mlp", 16, torch.device("cpu"))
    arguments = math_arguments(optimizer)
    eager = group_step(*arguments)
    compiled = torch.compile(group_step)(*arguments)
    # Float32 directions; Inductor may fuse and reorder the sums.
    assert largest_relative_difference(compiled, eager) < 1e-5
    assert compiled.slope.item() == pytest.approx(eager.slope.item(), rel=1e-5)
    assert eager.slope.item() < 0  # a descent direction


def counting(calls: list[int]):
    """``group_step``, appending to ``calls`` at each call."""

    def counted(*arguments):
        calls.append(1)
        return group_step(*arguments)

    return counted


def test_training_with_other_math_runs_it_in_every_step():
    calls: list[int] = []
    counted = counting(calls)
    device = torch.device("cpu")
    other, _, _ = trained("mlp", 16, device, math=counted)
    eager, _, _ = trained("mlp", 16, device)
    assert len(calls) == WARM_STEPS
    # The same function, eagerly.
    assert parameter_difference(parameters(other), parameters(eager)) == 0
    assert kronecker.group_step is group_step  # put back after each step


def test_packed_steps_run_their_own_math():
    """A packed step (the CUDA default) never calls ``group_step``.

    So the script compares by shape: swapping it would time the same step twice.
    """
    calls: list[int] = []
    trained("mlp-tiny", 8, torch.device("cpu"), math=counting(calls), packed=True)
    assert calls == []


def table_rows(out: str) -> list[str]:
    """The first cells of the printed markdown tables' rows."""
    return [
        line.split("|")[1].strip()
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith("| ---")
    ]


@pytest.mark.slow
def test_a_failed_training_is_reported_and_the_math_still_timed(monkeypatch, capsys):
    """A training with compiled math that fails (CUDA graph trees did on an H100)."""
    from benchmarks.micro import between_compile

    def failing(model_name, batch_size, device, math=group_step, packed=False):
        if math is not group_step:
            raise RuntimeError("accessing tensor output of CUDAGraphs")
        return trained(model_name, batch_size, device, packed=packed)

    monkeypatch.setattr(between_compile, "trained", failing)
    between_compile.main(["--model", "mlp-tiny", "--batch-size", "8", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "training with math compiled: failed" in out
    assert "training with math graphs: failed" in out
    assert table_rows(out) == [
        "variant",
        "sgd step",
        "default step",
        "by-shape step",
        "math eager",
        "math compiled",
        "math graphs",
    ]  # the one table: no training variant to time


@pytest.mark.slow
def test_trained_variants_compare_with_the_eager_run_of_as_many_steps(
    monkeypatch, capsys
):
    """The eager parameters are taken before the timing steps move them.

    Trainings whose math is the eager function itself end exactly there (the H100
    run of 2026-11-27 printed 7.6e-02 for both: the eager optimizer, timed, had
    stepped further).
    """
    from benchmarks.micro import between_compile

    def eagerly(model_name, batch_size, device, math=group_step, packed=False):
        return trained(model_name, batch_size, device, packed=packed)

    monkeypatch.setattr(between_compile, "trained", eagerly)
    between_compile.main(["--model", "mlp-tiny", "--batch-size", "8", "--repeats", "2"])
    out = capsys.readouterr().out
    for name in ("compiled", "graphs"):
        message = f"training with math {name}: {WARM_STEPS} steps, parameters 0.0e+00"
        assert message in out
    assert table_rows(out)[-5:] == [
        "sgd step",
        "default step",
        "by-shape step",
        "by-shape step, math compiled",
        "by-shape step, math graphs",
    ]
