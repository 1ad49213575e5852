"""DiagnosticsMonitor's gradient histograms vs numpy on the same (BackPACK) data."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dampednewton.diagnostics import (
    DiagnosticsMonitor,
    FixedRange,
    GradientHistogram,
    GradientParameterHistogram,
    MaxAbsRange,
    PercentileRange,
)
from dampednewton.diagnostics.bin_adaptation import range_hull
from dampednewton.diagnostics.histogram import uniform_bin_edges
from tests.utils import backpack_individual_gradients, run_monitored_step

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


def _histogram_monitor(case) -> DiagnosticsMonitor:
    return DiagnosticsMonitor(
        [
            GradientHistogram(bins=8, range_policy=PercentileRange(2.0, 98.0)),
            GradientParameterHistogram(bins=(4, 3)),
        ],
        case.model.named_parameters(),
    )


def test_a_resumed_monitor_continues_the_network_ranges(case, tmp_path):
    """Steps 2 and 3 after ``torch.save``/``load`` of the state: the same records."""
    monitor = _histogram_monitor(case)
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.1)
    records = []
    for step in range(4):
        if step == 2:
            torch.save(monitor.state_dict(), tmp_path / "monitor.pt")
            parameters = [p.detach().clone() for p in case.model.parameters()]
        records.append(run_monitored_step(case, monitor, step))
        optimizer.step()
    with torch.no_grad():
        for param, saved in zip(case.model.parameters(), parameters, strict=True):
            param.copy_(saved)
    resumed = _histogram_monitor(case)
    fresh = run_monitored_step(case, _histogram_monitor(case), 2)
    resumed.load_state_dict(torch.load(tmp_path / "monitor.pt"))
    for step in (2, 3):
        record = run_monitored_step(case, resumed, step)
        optimizer.step()
        assert record.keys() == records[step].keys()
        for key, value in record.items():
            np.testing.assert_array_equal(value, records[step][key], err_msg=key)
    # Without the state, the network histogram starts at the initial range again.
    assert not np.array_equal(fresh["grad_hist/edges"], records[2]["grad_hist/edges"])


def test_a_monitor_refuses_the_state_of_other_histograms(case):
    saved = _histogram_monitor(case).state_dict()
    other = DiagnosticsMonitor([GradientHistogram(label="other")])
    with pytest.raises(ValueError, match=r"\['grad_hist', 'grad_param_hist'\]"):
        other.load_state_dict(saved)
    saved["network_ranges"]["grad_hist"] = ((0.0, 1.0), (0.0, 1.0))
    with pytest.raises(ValueError, match=r"one network range per axis \(1\)"):
        _histogram_monitor(case).load_state_dict(saved)
    saved["network_ranges"]["grad_hist"] = ((1.0, 0.0),)
    with pytest.raises(ValueError, match="low < high"):
        _histogram_monitor(case).load_state_dict(saved)
