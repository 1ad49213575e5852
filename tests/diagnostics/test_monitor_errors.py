"""The monitor refuses bad models, bad passes and bad configurations."""

from __future__ import annotations

import copy

import pytest
import torch
from backpack import extend
from torch import nn

from dampednewton.diagnostics import GSNR, CurvatureTrace, DiagnosticsMonitor
from dampednewton.diagnostics.reducer import MissingQuantityError
from tests.cases import DIAGNOSTICS_PROBLEMS
from tests.utils import Case, build_case, run_monitored_step


def plain_model_case() -> Case:
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    reference_model = copy.deepcopy(case.reference_model)
    return Case(
        reference_model, case.loss_fn, reference_model, case.loss_fn, case.X, case.y
    )


def test_not_extended_model_raises():
    case = plain_model_case()
    monitor = DiagnosticsMonitor([GSNR()])
    with pytest.raises(RuntimeError, match=r"backpack\.extend"):
        run_monitored_step(case, monitor)


def test_not_extended_loss_raises_for_curvature():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    case.loss_fn = nn.CrossEntropyLoss()
    monitor = DiagnosticsMonitor([CurvatureTrace()])
    with pytest.raises(RuntimeError, match="extend the loss function"):
        run_monitored_step(case, monitor)


def test_parameter_outside_the_extended_model_raises():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    extra = nn.Parameter(torch.ones(2, dtype=torch.float64))
    monitor = DiagnosticsMonitor([GSNR()], {"extra": extra})
    loss = case.loss_fn(case.model(case.X), case.y) + (extra**2).sum()
    with monitor.backward_context(0):
        loss.backward()
    with pytest.raises(MissingQuantityError, match="'extra'"):
        monitor.finish(0, [*case.model.parameters(), extra], loss)


def test_a_loss_summed_over_the_batch_raises():
    """Histograms and traces would be N times too large (GSNR is scale-free)."""
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    case.loss_fn = extend(nn.CrossEntropyLoss(reduction="sum"))
    monitor = DiagnosticsMonitor([GSNR(), CurvatureTrace()])
    with pytest.raises(ValueError, match=r"reduction='sum'.*reduction='mean'"):
        run_monitored_step(case, monitor)
    assert len(monitor.log) == 0


def test_finish_without_monitored_backward_raises():
    monitor = DiagnosticsMonitor([GSNR()])
    with pytest.raises(RuntimeError, match="No monitored backward pass for step 3"):
        monitor.finish(3, [], None)


@pytest.mark.parametrize(
    ("diagnostics", "message"),
    [
        ([], "at least one"),
        ([GSNR(), GSNR(epsilon=1.0)], "distinct labels"),
        (
            [
                CurvatureTrace(curvature="diag_ggn_mc", mc_samples=1),
                CurvatureTrace(curvature="diag_ggn_mc", mc_samples=2, label="mc2"),
            ],
            "mc_samples",
        ),
    ],
    ids=["empty", "duplicate-labels", "mc-samples-conflict"],
)
def test_bad_monitor_configuration_raises(diagnostics, message):
    with pytest.raises(ValueError, match=message):
        DiagnosticsMonitor(diagnostics)


def test_a_name_instead_of_a_spec_names_the_specs():
    with pytest.raises(TypeError, match=r"Unknown diagnostic 'gsnr'; use one of GSNR"):
        DiagnosticsMonitor(["gsnr"])  # type: ignore[list-item]


def test_small_batch_for_debiased_gsnr_raises():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    case.X, case.y = case.X[:3], case.y[:3]
    with pytest.raises(
        ValueError,
        match=r"debiased GSNR needs a batch of at least 4 samples, got 3.*drop_last",
    ):
        run_monitored_step(case, DiagnosticsMonitor([GSNR()]))


def test_several_backward_passes_in_one_context_raise():
    """Micro-batches accumulated in one context are refused, nothing logged.

    Their record would mix the last micro-batch's per-sample quantities with the
    whole batch's .grad.
    """
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor([GSNR(), CurvatureTrace()])
    case.model.zero_grad()
    with (
        pytest.raises(RuntimeError, match="reached the monitor twice"),
        monitor.backward_context(0),
    ):
        for inputs, labels in zip(case.X.split(4), case.y.split(4), strict=True):
            case.loss_fn(case.model(inputs), labels).backward()
    assert len(monitor.log) == 0
    # One backward pass of the whole batch afterwards is logged as usual.
    assert run_monitored_step(case, monitor, step=1)["batch_size"] == len(case.X)
