"""The monitor's hooks, extension schedule, parameter names and devices."""

from __future__ import annotations

import numpy as np
import pytest
from backpack import backpack
from backpack.extensions import BatchGrad, DiagGGNExact, DiagHessian
from torch import nn

from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsMonitor,
    EveryKSteps,
    FixedRange,
    GradientHistogram,
    GradientParameterHistogram,
    NoiseScale,
)
from tests.cases import DIAGNOSTICS_PROBLEMS
from tests.utils import backpack_individual_gradients, build_case, run_monitored_step


def test_hook_leaves_quantities_for_a_following_hook():
    """As inside DampedNewton: the monitor's hook, then the optimizer's hook."""
    case = build_case(DIAGNOSTICS_PROBLEMS[2])
    diagnostics = [GSNR(), GradientHistogram(bins=5), CurvatureTrace()]
    seen = []

    def optimizer_hook(module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            for savefield in ("grad_batch", "sum_grad_squared", "diag_ggn_exact"):
                assert hasattr(param, savefield), f"{savefield} was deleted"
            seen.append(param.grad_batch.shape)
            del param.grad_batch

    monitor = DiagnosticsMonitor(diagnostics, case.model.named_parameters())
    extensions = monitor.extensions(0)
    hook = monitor.module_hook(0)

    def chained(module: nn.Module) -> None:
        hook(module)
        optimizer_hook(module)

    loss = case.loss_fn(case.model(case.X), case.y)
    with backpack(*extensions, extension_hook=chained):
        loss.backward()
    record = monitor.finish(0, case.model.parameters(), loss)
    assert len(seen) == len(list(case.model.parameters()))

    twin = build_case(DIAGNOSTICS_PROBLEMS[2])
    expected = run_monitored_step(
        twin, DiagnosticsMonitor(diagnostics, twin.model.named_parameters())
    )
    assert record.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(record[key], value, err_msg=key)


def test_histograms_of_a_subsampled_grad_batch_use_the_full_batch_size():
    """An optimizer may request BatchGrad(subsampling=...) in place of ours."""
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    individual = backpack_individual_gradients(case)
    subsampling = [0, 2, 5]
    fixed = FixedRange(-0.6, 0.6)
    monitor = DiagnosticsMonitor(
        [GradientHistogram(bins=7, range_policy=fixed)], case.model.named_parameters()
    )
    hook = monitor.module_hook(0)
    case.model.zero_grad()
    loss = case.loss_fn(case.model(case.X), case.y)
    with backpack(BatchGrad(subsampling=subsampling), extension_hook=hook):
        loss.backward()
    record = monitor.finish(0, case.model.parameters(), loss)
    assert record["batch_size"] == case.X.shape[0]
    for name, values in individual.items():
        expected, _ = np.histogram(
            values[subsampling].numpy(), bins=7, range=(-0.6, 0.6)
        )
        np.testing.assert_array_equal(record[f"grad_hist/counts/{name}"], expected)


def test_backward_context_frees_backpack_quantities():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor(
        [GSNR(), GradientHistogram(), CurvatureTrace(curvature="diag_h")]
    )
    run_monitored_step(case, monitor)
    for param in case.model.parameters():
        for savefield in ("grad_batch", "sum_grad_squared", "diag_h"):
            assert not hasattr(param, savefield), savefield
        assert param.grad is not None


def test_extensions_are_deduplicated_and_scheduled():
    monitor = DiagnosticsMonitor(
        [
            GSNR(schedule=EveryKSteps(2)),
            NoiseScale(schedule=EveryKSteps(2)),
            GradientHistogram(schedule=EveryKSteps(3)),
            GradientParameterHistogram(schedule=EveryKSteps(3)),
            CurvatureTrace(schedule=EveryKSteps(6), curvature="diag_h"),
        ]
    )

    def types(step):
        return sorted(type(ext).__name__ for ext in monitor.extensions(step))

    assert types(0) == ["BatchGrad", "DiagHessian", "SumGradSquared"]
    assert types(2) == ["SumGradSquared"]
    assert types(3) == ["BatchGrad"]
    assert types(1) == []
    assert not monitor.is_active(1)
    assert monitor.is_active(4)
    assert isinstance(
        DiagnosticsMonitor([CurvatureTrace()]).extensions(0)[0], DiagGGNExact
    )
    assert isinstance(
        DiagnosticsMonitor([CurvatureTrace(curvature="diag_h")]).extensions(0)[0],
        DiagHessian,
    )


def test_unscheduled_step_gives_empty_record_and_no_log_entry():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor([GSNR(schedule=EveryKSteps(2))])
    assert run_monitored_step(case, monitor, step=1) == {}
    assert len(monitor.log) == 0
    assert run_monitored_step(case, monitor, step=2)["step"] == 2
    assert len(monitor.log) == 1


def test_names_default_to_positions_and_follow_the_params_given():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor([CurvatureTrace()])
    case.model.zero_grad()
    loss = case.loss_fn(case.model(case.X), case.y)
    with monitor.backward_context(0):
        loss.backward()
    last_layer = list(case.model.parameters())[2:]
    record = monitor.finish(0, last_layer, loss)
    assert sorted(k for k in record if k.startswith("diag_ggn_exact/trace/")) == [
        "diag_ggn_exact/trace/param_0",
        "diag_ggn_exact/trace/param_1",
    ]
    assert record["loss"] == loss.item()


@pytest.mark.cuda
def test_cuda_record_equals_cpu_record():
    diagnostics = [
        GSNR(),
        NoiseScale(),
        GradientHistogram(bins=7, range_policy=FixedRange(-0.5, 0.5)),
        GradientParameterHistogram(bins=(3, 4), gradient_range=FixedRange(-0.5, 0.5)),
        CurvatureTrace(curvature="diag_h"),
    ]
    cpu = build_case(DIAGNOSTICS_PROBLEMS[2])
    gpu = build_case(DIAGNOSTICS_PROBLEMS[2])
    gpu.model.cuda()
    gpu.X, gpu.y = gpu.X.cuda(), gpu.y.cuda()
    expected = run_monitored_step(cpu, DiagnosticsMonitor(diagnostics))
    record = run_monitored_step(gpu, DiagnosticsMonitor(diagnostics))
    assert record.keys() == expected.keys()
    for key, value in expected.items():
        assert isinstance(record[key], type(value)), key
        np.testing.assert_allclose(
            record[key], value, rtol=1e-10, atol=1e-13, err_msg=key
        )
