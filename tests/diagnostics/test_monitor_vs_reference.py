"""DiagnosticsMonitor's GSNR, noise scale and curvature traces vs brute force."""

from __future__ import annotations

import io

import pytest
import torch
from backpack import backpack
from backpack.extensions import DiagGGNMC

from dampednewton.backpack.added_modules import use_added_modules
from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsMonitor,
    NoiseScale,
)
from dampednewton.diagnostics.trace import curvature_extension
from tests import reference
from tests.assertions import assert_scalar
from tests.cases import DIAGNOSTICS_PROBLEMS, case_by_id
from tests.utils import build_case, run_monitored_step, split_by_parameter

EPSILON = 1e-8
RTOL = 1e-9  # BackPACK vs. per-sample loops: round-off only


def test_gsnr_and_noise_scale_match_per_sample_loops(case_on_device):
    case = case_on_device
    monitor = DiagnosticsMonitor(
        [GSNR(epsilon=EPSILON), NoiseScale()], case.model.named_parameters()
    )
    record = run_monitored_step(case, monitor)
    params = case.reference_params(list(case.model.parameters()))
    per_sample = reference.per_sample_gradients(
        case.reference_model, case.reference_loss_fn, params, case.X, case.y
    )
    n = per_sample.shape[0]
    assert record["batch_size"] == n
    mean = per_sample.mean(0)
    variance = per_sample.var(0, correction=0)
    plain = mean**2 / (variance + EPSILON)
    debiased = ((n - 3) * mean**2 - variance) / (n * (variance + EPSILON))
    for name in split_by_parameter(mean, case):
        for key, values in (("mean", plain), ("mean_debiased", debiased)):
            assert_scalar(
                record[f"gsnr/{key}/{name}"],
                split_by_parameter(values, case)[name].mean(),
                f"gsnr/{key}/{name}",
                rtol=RTOL,
                atol=1e-12,
            )
    assert_scalar(record["gsnr/mean"], plain.mean(), "gsnr/mean", rtol=RTOL)
    assert_scalar(
        record["gsnr/mean_debiased"],
        debiased.mean(),
        "gsnr/mean_debiased",
        rtol=RTOL,
        atol=1e-12,
    )
    trace = per_sample.var(0, correction=1).sum()
    norm = (mean**2).sum() - trace / n
    expected = {
        "trace_covariance": trace,
        "squared_gradient_norm": norm,
        "b_simple": trace / norm if norm > 0 else torch.inf,
        "trace_covariance_plain": variance.sum(),
        "squared_gradient_norm_plain": (mean**2).sum(),
        "b_simple_plain": variance.sum() / (mean**2).sum(),
    }
    for key, value in expected.items():
        assert record[f"noise_scale/{key}"] == pytest.approx(float(value), rel=RTOL), (
            key
        )


def test_curvature_traces_match_autograd_and_jacobians(case_on_device):
    case = case_on_device
    monitor = DiagnosticsMonitor(
        [
            CurvatureTrace(curvature="diag_h"),
            CurvatureTrace(curvature="diag_ggn_exact"),
        ],
        case.model.named_parameters(),
    )
    record = run_monitored_step(case, monitor)
    params = case.reference_params(list(case.model.parameters()))
    args = (case.reference_model, case.reference_loss_fn, params, case.X, case.y)
    for curvature, diagonal in (
        ("diag_h", reference.hessian_diagonal(*args)),
        ("diag_ggn_exact", reference.ggn_diagonal(*args)),
    ):
        for name, piece in split_by_parameter(diagonal, case).items():
            assert_scalar(
                record[f"{curvature}/trace/{name}"],
                piece.sum(),
                f"{curvature} trace of {name}",
                rtol=RTOL,
                atol=1e-12,
            )
        assert_scalar(
            record[f"{curvature}/trace"], diagonal.sum(), curvature, rtol=RTOL
        )


def test_hessian_and_ggn_traces_differ_with_sigmoid():
    sigmoid = build_case(case_by_id("mlp-sigmoid-ce-n6"))
    monitor = DiagnosticsMonitor(
        [CurvatureTrace(curvature="diag_h"), CurvatureTrace(curvature="diag_ggn_exact")]
    )
    record = run_monitored_step(sigmoid, monitor)
    assert abs(record["diag_h/trace"] - record["diag_ggn_exact/trace"]) > 1e-3


def monte_carlo_reference(case, seed: int) -> dict[str, float]:
    """Each parameter's ``diag_ggn_mc`` trace, drawn from the global state seeded."""
    case.model.zero_grad()
    torch.manual_seed(seed)
    # BackPACK's own extension where it supports the loss; for multi-label binary
    # cross-entropy (BackPACK refuses (N, C) logits) the package's, unseeded.
    extension = (
        curvature_extension("diag_ggn_mc", 3)
        if isinstance(case.loss_fn, torch.nn.BCEWithLogitsLoss)
        else DiagGGNMC(mc_samples=3)
    )
    use_added_modules(extension)  # GELU, Softplus, ...: the package's derivatives
    with backpack(extension):
        case.loss_fn(case.model(case.X), case.y).backward()
    return {
        name: param.diag_ggn_mc.sum().item()
        for name, param in case.model.named_parameters()
    }


@pytest.mark.parametrize("problem", DIAGNOSTICS_PROBLEMS, ids=lambda case: case.id)
def test_monte_carlo_trace_draws_from_the_monitors_seed(problem):
    case = build_case(problem)
    monitor = DiagnosticsMonitor(
        [CurvatureTrace(curvature="diag_ggn_mc", mc_samples=3)],
        case.model.named_parameters(),
        seed=123,
    )
    torch.manual_seed(7)
    global_state = torch.get_rng_state()
    record = run_monitored_step(case, monitor)
    # The user's random stream is untouched by the monitored step.
    assert torch.equal(torch.get_rng_state(), global_state)
    expected = monte_carlo_reference(case, 123)
    for name, trace in expected.items():
        assert record[f"diag_ggn_mc/trace/{name}"] == trace


def test_monte_carlo_trace_resumes_its_draws_from_the_state_dict():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])

    def monitor() -> DiagnosticsMonitor:
        return DiagnosticsMonitor(
            [CurvatureTrace(curvature="diag_ggn_mc", mc_samples=3)],
            case.model.named_parameters(),
            seed=5,
        )

    uninterrupted = monitor()
    first = run_monitored_step(case, uninterrupted, step=0)
    second = run_monitored_step(case, uninterrupted, step=1)
    assert first["diag_ggn_mc/trace"] != second["diag_ggn_mc/trace"]  # new draws
    interrupted = monitor()
    run_monitored_step(case, interrupted, step=0)
    saved = interrupted.state_dict()
    resumed = monitor()
    resumed.load_state_dict(torch.load(_saved(saved), weights_only=True))
    assert run_monitored_step(case, resumed, step=1) == second
    # A state of an earlier version (no generator) still loads: draws from the seed.
    fresh = monitor()
    fresh.load_state_dict({"network_ranges": {}})
    assert run_monitored_step(case, fresh, step=0) == first


def _saved(state: dict) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_the_default_seed_comes_from_torchs_initial_seed_without_drawing():
    """seed=None: the global stream stays where it was; manual_seed fixes the draws."""
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    traces = []
    for _ in range(2):
        torch.manual_seed(11)
        state = torch.get_rng_state()
        monitor = DiagnosticsMonitor(
            [CurvatureTrace(curvature="diag_ggn_mc")], case.model.named_parameters()
        )
        assert torch.equal(torch.get_rng_state(), state)
        traces.append(run_monitored_step(case, monitor)["diag_ggn_mc/trace"])
        assert torch.equal(torch.get_rng_state(), state)
    assert traces[0] == traces[1]
