"""A step that raises leaves no trace, also after it moved the parameters.

An adaptive damping (Levenberg-Marquardt) calls the closure a second time, at the
moved parameters; when that call raises (a data loader's hiccup, an interrupt), the
step is undone: parameters, state and generator as before, and the training that
follows is bitwise the training that never saw the failure. A step that fails on
its first call leaves even the state dict's keys as they were, on the first step too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from dampednewton import DampedNewton, GramBasis, LevenbergMarquardt
from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsMonitor,
    GradientHistogram,
)
from tests.cases import PROBLEMS
from tests.utils import (
    assert_parameters_equal,
    assert_same_state,
    build_case,
    make_closure,
    snapshot,
)

MLP_CE = PROBLEMS[0]
ADAPTIVE = {
    "kronecker-unaveraged": lambda: {
        "averaging": None,
        "damping": LevenbergMarquardt(value=3e-3, interval=1),
    },
    "kronecker-at-refresh": lambda: {
        "damping": LevenbergMarquardt(value=3e-3, interval=1)
    },
    "gram": lambda: {
        "basis": GramBasis(),
        "damping": LevenbergMarquardt(value=0.1, interval=1),
    },
    "gram-unaveraged": lambda: {
        "basis": GramBasis(),
        "averaging": None,
        "damping": LevenbergMarquardt(value=0.1, interval=1),
    },
}
GOOD_STEPS = {
    "kronecker-unaveraged": 4,
    "kronecker-at-refresh": 3,
    "gram": 3,
    "gram-unaveraged": 4,
}
"""Steps before the failing one: both bases adapt their damping only on a refresh
(the averaged ones' step 3, not the steps along their kept bases; without averaging
every step, here step 4, whose bases replace those cached beside the state)."""


class FlakyClosure:
    """The closure pattern, raising on one chosen call (counted from 1)."""

    def __init__(self, closure: Callable[[], torch.Tensor]) -> None:
        self.closure = closure
        self.calls = 0
        self.fail_on: int | None = None

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("the data loader failed")
        return self.closure()


def twin_runs(
    config: str, monitor: Callable | None = None, mc_samples: int = 1
) -> list[tuple]:
    """Two equal runs of ``config`` after its good steps.

    Each is ``(case, optimizer, closure)``, the closure able to fail on a call.
    """
    runs = []
    for _ in range(2):
        case = build_case(MLP_CE)
        optimizer = DampedNewton(
            case.model.parameters(),
            mc_samples=mc_samples,
            seed=0,
            monitor=None if monitor is None else monitor(case),
            **ADAPTIVE[config](),
        )
        closure = FlakyClosure(
            make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        )
        runs.append((case, optimizer, closure))
    for _ in range(GOOD_STEPS[config]):
        for _, optimizer, closure in runs:
            optimizer.step(closure)
    return runs


@pytest.mark.parametrize("mc_samples", [0, 1], ids=["exact", "monte-carlo"])
@pytest.mark.parametrize("config", list(ADAPTIVE))
def test_a_failed_second_closure_call_undoes_the_step(config: str, mc_samples: int):
    (case, optimizer, closure), (twin_case, twin, twin_closure) = twin_runs(
        config, mc_samples=mc_samples
    )
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)
    damping = optimizer.param_groups[0]["damping"]
    adapted = (damping.value, damping.updates)
    closure.fail_on = closure.calls + 2  # the adaptation's call

    with pytest.raises(RuntimeError, match="the data loader failed"):
        optimizer.step(closure)

    assert closure.calls == closure.fail_on  # it did fail on the second call
    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), before)
    assert (damping.value, damping.updates) == adapted
    for _ in range(4):  # caches rebuilt from the restored state: the same steps
        optimizer.step(closure)
        twin.step(twin_closure)
    assert_parameters_equal(params, [p.detach() for p in twin_case.model.parameters()])
    assert_same_state(snapshot(optimizer), snapshot(twin))


def _nan_inputs(case):
    inputs = case.X.clone()
    inputs[0, 0] = math.nan
    return inputs, case.y


def _ignored_target(case):
    return case.X, torch.cat([case.y[:-1], torch.tensor([-100])])


@pytest.mark.parametrize(
    "basis", [{}, {"basis": GramBasis()}], ids=["kronecker", "gram"]
)
@pytest.mark.parametrize(
    "bad_batch", [_nan_inputs, _ignored_target], ids=["nan-input", "ignored-target"]
)
def test_a_failed_first_step_leaves_the_state_dict_of_a_fresh_optimizer(
    bad_batch, basis
):
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), seed=0, **basis)
    fresh = snapshot(optimizer)
    inputs, targets = bad_batch(case)

    with pytest.raises((FloatingPointError, ValueError)):
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, inputs, targets)
        )

    assert_same_state(snapshot(optimizer), fresh)


def _monitor(case) -> DiagnosticsMonitor:
    return DiagnosticsMonitor(
        [GSNR(), GradientHistogram(bins=8), CurvatureTrace(curvature="diag_ggn_mc")],
        case.model.named_parameters(),
        seed=1,
    )


@pytest.mark.parametrize("config", ["kronecker-at-refresh", "gram"])
def test_a_failed_step_leaves_no_record_and_takes_no_draw_of_the_monitor(config):
    """The monitor's log, histogram ranges and trace draws are undone with the step.

    Reference: the same run without the failure; the retried step's record equals
    its record there, and so do the later ones.
    """
    (_, optimizer, closure), (_, twin, twin_closure) = twin_runs(config, _monitor)
    monitor, twin_monitor = optimizer.monitor, twin.monitor
    assert monitor is not None and twin_monitor is not None
    closure.fail_on = closure.calls + 2  # the adaptation's call
    with pytest.raises(RuntimeError, match="the data loader failed"):
        optimizer.step(closure)
    assert len(monitor.log) == GOOD_STEPS[config]
    for _ in range(2):
        optimizer.step(closure)
        twin.step(twin_closure)
    assert [r["step"] for r in monitor.log] == [r["step"] for r in twin_monitor.log]
    for record, expected in zip(monitor.log, twin_monitor.log, strict=True):
        assert record.keys() == expected.keys()
        for key, value in expected.items():
            assert np.array_equal(record[key], value), key
