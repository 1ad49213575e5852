"""DiagnosticsMonitor vs brute-force references and vs the standalone functions."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from backpack import backpack
from backpack.extensions import (
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SumGradSquared,
)
from torch import Tensor, nn

from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsMonitor,
    EveryKSteps,
    FixedRange,
    GradientHistogram,
    GradientParameterHistogram,
    MaxAbsRange,
    NoiseScale,
    PercentileRange,
)
from dampednewton.diagnostics.bin_adaptation import range_hull
from dampednewton.diagnostics.gsnr import (
    debiased_gsnr,
    gsnr,
    per_sample_variance,
    unbiased_noise_scale,
)
from dampednewton.diagnostics.histogram import uniform_bin_edges
from dampednewton.diagnostics.reducer import MissingQuantityError
from tests import reference
from tests.assertions import assert_close
from tests.cases import DIAGNOSTICS_PROBLEMS, case_by_id
from tests.utils import Case, build_case, run_monitored_step

EPSILON = 1e-8
RTOL = 1e-9  # BackPACK vs. per-sample loops: round-off only


def named_parameters(case: Case) -> list[tuple[str, Tensor]]:
    return list(case.model.named_parameters())


def split(vector: Tensor, case: Case) -> dict[str, Tensor]:
    """Split a vector over all parameters into named per-parameter pieces."""
    names, params = zip(*named_parameters(case), strict=True)
    pieces = reference.unflatten(vector, list(params))
    return dict(zip(names, pieces, strict=True))


def assert_scalar(actual: float, expected: Tensor | float, name: str, **tols) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert_close(torch.tensor(actual, dtype=torch.float64), expected, name=name, **tols)


# --- Acceptance: BackPACK through the monitor vs brute force -------------------------


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
    for name in split(mean, case):
        for key, values in (("mean", plain), ("mean_debiased", debiased)):
            assert_scalar(
                record[f"gsnr/{key}/{name}"],
                split(values, case)[name].mean(),
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
        for name, piece in split(diagonal, case).items():
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


def test_monte_carlo_ggn_trace_equals_backpack_with_same_seed():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    monitor = DiagnosticsMonitor(
        [CurvatureTrace(curvature="diag_ggn_mc", mc_samples=3)],
        case.model.named_parameters(),
    )
    torch.manual_seed(123)
    record = run_monitored_step(case, monitor)
    case.model.zero_grad()
    torch.manual_seed(123)
    with backpack(DiagGGNMC(mc_samples=3)):
        case.loss_fn(case.model(case.X), case.y).backward()
    for name, param in case.model.named_parameters():
        assert record[f"diag_ggn_mc/trace/{name}"] == param.diag_ggn_mc.sum().item()


# --- Histograms vs numpy on the same (BackPACK) data ----------------------------------


def backpack_individual_gradients(case: Case) -> dict[str, Tensor]:
    """``N·grad_batch`` of every parameter from a plain BackPACK pass."""
    case.model.zero_grad()
    with backpack(BatchGrad()):
        case.loss_fn(case.model(case.X), case.y).backward()
    n = case.X.shape[0]
    result = {}
    for name, param in case.model.named_parameters():
        result[name] = param.grad_batch * n
        del param.grad_batch
    return result


HISTOGRAM_POLICIES = {
    "fixed": FixedRange(-0.5, 0.5),
    "max-abs": MaxAbsRange(0.1),
    "percentile": PercentileRange(5.0, 95.0, 0.1),
}


@pytest.fixture(params=list(HISTOGRAM_POLICIES), ids=list(HISTOGRAM_POLICIES))
def policy(request):
    return HISTOGRAM_POLICIES[request.param]


def test_histograms_match_numpy(case, policy):
    individual = backpack_individual_gradients(case)
    bins, bins_2d = 11, (6, 5)
    monitor = DiagnosticsMonitor(
        [
            GradientHistogram(
                bins=bins, range_policy=policy, initial_range=(-0.3, 0.2)
            ),
            GradientParameterHistogram(
                bins=bins_2d,
                gradient_range=policy,
                parameter_range=MaxAbsRange(0.0),
                initial_parameter_range=(-0.7, 0.7),
            ),
        ],
        case.model.named_parameters(),
    )
    record = run_monitored_step(case, monitor)
    for name, param in case.model.named_parameters():
        values = individual[name].numpy()
        grad_range = policy.compute(individual[name])
        counts, edges = np.histogram(values, bins=bins, range=grad_range)
        np.testing.assert_array_equal(record[f"grad_hist/counts/{name}"], counts)
        np.testing.assert_array_equal(record[f"grad_hist/edges/{name}"], edges)
        outside = (values < grad_range[0]).sum(), (values > grad_range[1]).sum()
        assert (
            record[f"grad_hist/below/{name}"],
            record[f"grad_hist/above/{name}"],
        ) == outside
        assert counts.sum() + sum(outside) == values.size

        param_values = np.broadcast_to(param.detach().numpy(), values.shape)
        param_range = max(abs(param_values.min()), abs(param_values.max()))
        counts_2d, _, _ = np.histogram2d(
            values.ravel(),
            param_values.ravel(),
            bins=bins_2d,
            range=(grad_range, (-param_range, param_range)),
        )
        np.testing.assert_array_equal(
            record[f"grad_param_hist/counts/{name}"], counts_2d
        )
        margins = record[f"grad_param_hist/margins/{name}"]
        assert margins[1, 1] == counts_2d.sum()
        assert margins.sum() == values.size
        assert margins[0].sum() == outside[0] and margins[2].sum() == outside[1]

    everything = np.concatenate([v.numpy().ravel() for v in individual.values()])
    counts, edges = np.histogram(everything, bins=bins, range=(-0.3, 0.2))
    np.testing.assert_array_equal(record["grad_hist/counts"], counts)
    np.testing.assert_array_equal(record["grad_hist/edges"], edges)
    total = sum(record[f"grad_hist/{k}"] for k in ("below", "above", "nan"))
    assert record["grad_hist/counts"].sum() + total == everything.size
    assert record["grad_param_hist/margins"].sum() == everything.size


def test_network_histogram_range_follows_previous_step(case):
    monitor = DiagnosticsMonitor(
        [
            GradientHistogram(bins=8, range_policy=PercentileRange(2.0, 98.0)),
            GradientParameterHistogram(bins=(4, 3)),
        ],
        case.model.named_parameters(),
    )
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.1)
    records = []
    for step in range(3):
        records.append(run_monitored_step(case, monitor, step))
        optimizer.step()
    names = [name for name, _ in case.model.named_parameters()]
    for previous, current in itertools.pairwise(records):
        for label, edges_key in (
            ("grad_hist", "edges"),
            ("grad_param_hist", "x_edges"),
            ("grad_param_hist", "y_edges"),
        ):
            hull = range_hull(
                (
                    previous[f"{label}/{edges_key}/{n}"][0],
                    previous[f"{label}/{edges_key}/{n}"][-1],
                )
                for n in names
            )
            bins = len(current[f"{label}/{edges_key}"]) - 1
            expected = uniform_bin_edges(*hull, bins).numpy()
            np.testing.assert_array_equal(current[f"{label}/{edges_key}"], expected)


def test_cockpit_semantics_match_numpy_with_clipping(case, policy):
    """Clamped into the edge bins; the network range is this step's hull.

    Two steps with SGD in between: at each, the per-parameter and network
    histograms equal ``numpy.histogram``/``numpy.histogram2d`` of the values clipped
    (in numpy) into the per-parameter range and into the hull of this step's
    per-parameter ranges.
    """
    bins, bins_2d = 11, (6, 5)
    parameter_range = PercentileRange(10.0, 90.0, 0.0)
    monitor = DiagnosticsMonitor(
        [
            GradientHistogram(bins=bins, range_policy=policy, semantics="cockpit"),
            GradientParameterHistogram(
                bins=bins_2d,
                gradient_range=policy,
                parameter_range=parameter_range,
                semantics="cockpit",
            ),
        ],
        case.model.named_parameters(),
    )
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.5)
    for step in range(2):
        individual = backpack_individual_gradients(case)
        record = run_monitored_step(case, monitor, step)
        gradient_ranges, parameter_ranges, pairs = [], [], []
        for name, param in case.model.named_parameters():
            values = individual[name].numpy()
            param_values = np.broadcast_to(param.detach().numpy(), values.shape)
            grad_range = policy.compute(individual[name])
            param_range = parameter_range.compute(param.detach())
            gradient_ranges.append(grad_range)
            parameter_ranges.append(param_range)
            pairs.append((values.ravel(), param_values.ravel()))
            counts, edges = np.histogram(
                np.clip(values, *grad_range), bins=bins, range=grad_range
            )
            np.testing.assert_array_equal(record[f"grad_hist/counts/{name}"], counts)
            np.testing.assert_array_equal(record[f"grad_hist/edges/{name}"], edges)
            counts_2d, _, _ = np.histogram2d(
                np.clip(values.ravel(), *grad_range),
                np.clip(param_values.ravel(), *param_range),
                bins=bins_2d,
                range=(grad_range, param_range),
            )
            np.testing.assert_array_equal(
                record[f"grad_param_hist/counts/{name}"], counts_2d
            )
        hull, param_hull = range_hull(gradient_ranges), range_hull(parameter_ranges)
        everything = np.concatenate([x for x, _ in pairs])
        counts, edges = np.histogram(np.clip(everything, *hull), bins=bins, range=hull)
        np.testing.assert_array_equal(record["grad_hist/counts"], counts)
        np.testing.assert_array_equal(record["grad_hist/edges"], edges)
        assert record["grad_hist/counts"].sum() == everything.size
        counts_2d, x_edges, y_edges = np.histogram2d(
            np.clip(everything, *hull),
            np.clip(np.concatenate([y for _, y in pairs]), *param_hull),
            bins=bins_2d,
            range=(hull, param_hull),
        )
        np.testing.assert_array_equal(record["grad_param_hist/counts"], counts_2d)
        np.testing.assert_array_equal(record["grad_param_hist/x_edges"], x_edges)
        np.testing.assert_array_equal(record["grad_param_hist/y_edges"], y_edges)
        optimizer.step()


def test_network_histogram_is_sum_of_layers_with_a_fixed_range(case):
    fixed = FixedRange(-0.4, 0.4)
    monitor = DiagnosticsMonitor(
        [GradientHistogram(bins=9, range_policy=fixed, initial_range=(-0.4, 0.4))]
    )
    record = run_monitored_step(case, monitor)
    names = [f"param_{i}" for i, _ in enumerate(case.model.parameters())]
    for field in ("counts", "below", "above", "nan"):
        layers = sum(record[f"grad_hist/{field}/{name}"] for name in names)
        np.testing.assert_array_equal(record[f"grad_hist/{field}"], layers)


# --- The context helper with SGD vs the standalone functions ------------------------


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


# --- Plumbing -------------------------------------------------------------------------


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


def test_small_batch_for_debiased_gsnr_raises():
    case = build_case(DIAGNOSTICS_PROBLEMS[0])
    case.X, case.y = case.X[:3], case.y[:3]
    with pytest.raises(ValueError, match="batch_size must be ≥ 4"):
        run_monitored_step(case, DiagnosticsMonitor([GSNR()]))


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
