"""The monitor's backward context with torch optimizers vs the standalone functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backpack import backpack
from backpack.extensions import DiagGGNExact, SumGradSquared

from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsMonitor,
    FixedRange,
    GradientHistogram,
    NoiseScale,
)
from dampednewton.diagnostics.gsnr import (
    debiased_gsnr,
    gsnr,
    per_sample_variance,
    unbiased_noise_scale,
)
from tests import reference
from tests.assertions import assert_close, assert_scalar
from tests.cases import DIAGNOSTICS_PROBLEMS
from tests.utils import build_case, run_monitored_step

EPSILON = 1e-8
RTOL = 1e-9  # BackPACK vs. per-sample loops: round-off only


def test_context_helper_with_sgd_equals_standalone_functions():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    reference_case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor(
        [
            GSNR(epsilon=EPSILON),
            NoiseScale(),
            CurvatureTrace(curvature="diag_ggn_exact"),
        ],
        case.model.named_parameters(),
    )
    optimizers = [
        torch.optim.SGD(c.model.parameters(), lr=0.2, momentum=0.9)
        for c in (case, reference_case)
    ]
    n = case.X.shape[0]
    for step in range(3):
        record = run_monitored_step(case, monitor, step)
        reference_case.model.zero_grad()
        with backpack(SumGradSquared(), DiagGGNExact()):
            reference_case.loss_fn(
                reference_case.model(reference_case.X), reference_case.y
            ).backward()
        plain_all, debiased_all, traces = [], [], []
        norm, variance_sum = 0.0, 0.0
        for name, param in reference_case.model.named_parameters():
            variance = per_sample_variance(param.grad, param.sum_grad_squared, n)
            plain = gsnr(param.grad, variance, EPSILON)
            debiased = debiased_gsnr(param.grad, variance, n, EPSILON)
            assert_scalar(record[f"gsnr/mean/{name}"], plain.mean(), name, rtol=1e-13)
            assert_scalar(
                record[f"gsnr/mean_debiased/{name}"],
                debiased.mean(),
                name,
                rtol=1e-13,
                atol=1e-15,
            )
            assert_scalar(
                record[f"diag_ggn_exact/trace/{name}"],
                param.diag_ggn_exact.sum(),
                name,
                rtol=1e-13,
            )
            plain_all.append(plain.flatten())
            debiased_all.append(debiased.flatten())
            traces.append(param.diag_ggn_exact.sum())
            norm = norm + (param.grad**2).sum()
            variance_sum = variance_sum + variance.sum()
        assert_scalar(
            record["gsnr/mean"], torch.cat(plain_all).mean(), "mean", rtol=1e-13
        )
        assert_scalar(
            record["gsnr/mean_debiased"],
            torch.cat(debiased_all).mean(),
            "mean_debiased",
            rtol=1e-12,
        )
        assert_scalar(record["diag_ggn_exact/trace"], sum(traces), "trace", rtol=1e-13)
        noise = unbiased_noise_scale(norm, variance_sum, n)
        for key in ("trace_covariance", "squared_gradient_norm"):
            assert_scalar(
                record[f"noise_scale/{key}"], getattr(noise, key), key, rtol=1e-12
            )
        assert record["noise_scale/b_simple"] == pytest.approx(
            noise.noise_scale.item(), rel=1e-12
        )
        for optimizer in optimizers:
            optimizer.step()
    assert [record["step"] for record in monitor.log] == [0, 1, 2]
    for param, twin in zip(
        case.model.parameters(), reference_case.model.parameters(), strict=True
    ):
        assert torch.equal(param, twin), "the monitor must not change the training"


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
        lambda params: torch.optim.Adam(params, lr=1e-2),
    ],
    ids=["SGD", "Adam"],
)
def test_backward_context_alone_logs_records_with_any_optimizer(make_optimizer):
    """No second call: the context finishes the record; it equals brute force.

    The record is finished when the context exits, before the optimizer changes
    ``p.grad`` or the parameters.
    """
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor(
        [GSNR(epsilon=EPSILON), GradientHistogram(range_policy=FixedRange(-1, 1))],
        case.model.named_parameters(),
    )
    optimizer = make_optimizer(case.model.parameters())
    reference_params = case.reference_params(list(case.model.parameters()))
    expected_gsnr, expected_counts, losses = [], [], []
    for step in range(3):
        with torch.no_grad():
            for param, twin in zip(
                case.model.parameters(), reference_params, strict=True
            ):
                twin.copy_(param)
        per_sample = reference.per_sample_gradients(
            case.reference_model,
            case.reference_loss_fn,
            reference_params,
            case.X,
            case.y,
        )
        mean, variance = per_sample.mean(0), per_sample.var(0, correction=0)
        expected_gsnr.append((mean**2 / (variance + EPSILON)).mean().item())
        expected_counts.append(np.histogram(per_sample.numpy(), 64, (-1, 1))[0])
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(case.X), case.y)
        losses.append(loss.item())
        with monitor.backward_context(step, loss):
            loss.backward()
        optimizer.step()
    steps, values = monitor.log.series("gsnr/mean")
    assert steps.tolist() == [0, 1, 2]
    assert_close(
        torch.from_numpy(values),
        torch.tensor(expected_gsnr, dtype=torch.float64),
        rtol=RTOL,
        name="gsnr",
    )
    assert monitor.log.series("loss")[1].tolist() == losses
    for record, counts in zip(monitor.log, expected_counts, strict=True):
        np.testing.assert_array_equal(record["grad_hist/counts"], counts)
        names = [name for name, _ in case.model.named_parameters()]
        assert [k.split("/")[-1] for k in record if "gsnr/mean/" in k] == names


def test_finish_after_the_context_replaces_its_record():
    """The two-call pattern still works: finish re-assembles for its parameters."""
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor([CurvatureTrace()])
    case.model.zero_grad()
    loss = case.loss_fn(case.model(case.X), case.y)
    with monitor.backward_context(0):
        loss.backward()
    automatic = dict(monitor.log[-1])
    assert "loss" not in automatic
    assert sorted(k for k in automatic if k.startswith("diag_ggn_exact/trace/")) == [
        f"diag_ggn_exact/trace/param_{i}" for i in range(4)
    ]
    record = monitor.finish(0, case.model.parameters(), loss)
    assert len(monitor.log) == 1 and monitor.log[-1] is record
    assert record["loss"] == loss.item()
    assert {k: v for k, v in record.items() if k != "loss"} == automatic
