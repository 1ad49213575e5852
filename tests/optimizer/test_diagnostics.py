"""Diagnostics attached to DampedNewton: same numbers as standalone, same steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dampednewton import DampedNewton, GramBasis, KroneckerBasis, NoiseAwareDamping
from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsMonitor,
    EveryKSteps,
    GradientHistogram,
    GradientParameterHistogram,
    NoiseScale,
)
from tests.cases import PROBLEMS
from tests.utils import EXACT_VIVIT_STEP, build_case, make_closure

NUM_STEPS = 3


def make_monitor(model) -> DiagnosticsMonitor:
    return DiagnosticsMonitor(
        [
            GSNR(EveryKSteps(1)),
            NoiseScale(EveryKSteps(1)),
            GradientHistogram(EveryKSteps(2), bins=16),
            GradientParameterHistogram(EveryKSteps(2), bins=(8, 6)),
            CurvatureTrace(EveryKSteps(1), curvature="diag_ggn_exact"),
        ],
        named_parameters=model.named_parameters(),
    )


def assert_same_record(attached: dict, standalone: dict) -> None:
    keys = {k for k in attached if not k.startswith("newton/")}
    assert keys == set(standalone), keys ^ set(standalone)
    for key in keys:
        np.testing.assert_allclose(
            np.asarray(attached[key], dtype=float),
            np.asarray(standalone[key], dtype=float),
            rtol=1e-12,
            atol=1e-15,
            err_msg=key,
        )


@pytest.mark.parametrize("damping", [0.1, NoiseAwareDamping(0.1)], ids=["mean", "ps"])
@pytest.mark.parametrize("problem", [PROBLEMS[0], PROBLEMS[3]], ids=lambda p: p.id)
def test_attached_diagnostics_match_standalone_and_keep_the_step(problem, damping):
    attached, plain = build_case(problem), build_case(problem)
    monitor, standalone = make_monitor(attached.model), make_monitor(plain.model)
    opt_attached = DampedNewton(
        attached.model.parameters(),
        damping=damping,
        criterion=3,
        monitor=monitor,
        **EXACT_VIVIT_STEP,
    )
    opt_plain = DampedNewton(
        plain.model.parameters(), damping=damping, criterion=3, **EXACT_VIVIT_STEP
    )
    for step in range(NUM_STEPS):
        # standalone diagnostics at the same parameters, with a plain backward pass
        opt_plain.zero_grad()
        loss = plain.loss_fn(plain.model(plain.X), plain.y)
        with standalone.backward_context(step):
            loss.backward()
        expected = standalone.finish(step, plain.model.parameters(), loss)
        opt_attached.step(
            make_closure(
                opt_attached, attached.model, attached.loss_fn, attached.X, attached.y
            )
        )
        opt_plain.step(
            make_closure(opt_plain, plain.model, plain.loss_fn, plain.X, plain.y)
        )
        assert_same_record(monitor.log[-1], expected)
        for a, b in zip(
            attached.model.parameters(), plain.model.parameters(), strict=True
        ):
            assert torch.equal(a, b), "diagnostics changed the step"
        record = monitor.log[-1]
        stats = opt_attached.records["groups"][0]
        assert record["newton/num_directions/group0"] == stats["num_directions"]
        np.testing.assert_array_equal(record["newton/evals/group0"], stats["evals"])
        scale = record["newton/trust_region_scale/group0"]
        assert scale == stats["trust_region_scale"] and 0 < scale <= 1
    assert len(monitor.log) == NUM_STEPS
    leftovers = [
        name
        for p in attached.model.parameters()
        for name in ("grad_batch", "sum_grad_squared", "diag_ggn_exact")
        if hasattr(p, name)
    ]
    assert not leftovers, leftovers


def test_histograms_need_full_batch_gradients():
    case = build_case(PROBLEMS[0])
    optimizer = DampedNewton(
        case.model.parameters(),
        damping=NoiseAwareDamping(),
        criterion=2,
        subsampling_grad=[0, 1],
        monitor=make_monitor(case.model),
        **EXACT_VIVIT_STEP,
    )
    with pytest.raises(ValueError, match="subsampling_grad=None"):
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        )


@pytest.mark.parametrize("basis", [KroneckerBasis(), GramBasis()], ids=repr)
@pytest.mark.filterwarnings("ignore:1 of the 12 GGN eigenvalues")
def test_records_count_step_calls_also_after_a_skipped_step(basis):
    """A record's step is the training loop's counter (Lightning's global_step).

    With nonfinite="skip" a refused batch advances the loop, not the optimizer's
    steps taken; the monitor's records (and its schedule) follow the loop.
    """
    case = build_case(PROBLEMS[0])
    monitor = DiagnosticsMonitor([GSNR()], case.model.named_parameters())
    optimizer = DampedNewton(
        case.model.parameters(), basis=basis, nonfinite="skip", monitor=monitor
    )
    poisoned = case.X.clone()
    poisoned[0, 0] = float("nan")
    for step in range(6):
        inputs = poisoned if step == 3 else case.X
        closure = make_closure(optimizer, case.model, case.loss_fn, inputs, case.y)
        if step == 3:
            with pytest.warns(RuntimeWarning, match="refused the update"):
                optimizer.step(closure)
        else:
            optimizer.step(closure)
    assert optimizer.records["global"]["step"] == 5
    assert [record["step"] for record in monitor.log] == [0, 1, 2, 4, 5]


@pytest.mark.parametrize("basis", [KroneckerBasis(), GramBasis()], ids=repr)
@pytest.mark.parametrize("step", [1, 2], ids=["refresh", "between"])
@pytest.mark.filterwarnings("ignore:1 of the 12 GGN eigenvalues")
def test_a_monte_carlo_trace_does_not_stop_a_non_finite_step_from_being_skipped(
    basis, step
):
    """The trace samples a NaN output as zeros and flags it; the step is skipped."""
    case = build_case(PROBLEMS[0])
    trace = CurvatureTrace(curvature="diag_ggn_mc")
    monitor = DiagnosticsMonitor([trace], case.model.named_parameters(), seed=0)
    optimizer = DampedNewton(
        case.model.parameters(),
        basis=basis,
        mc_samples=0,
        nonfinite="skip",
        monitor=monitor,
    )
    for _ in range(step):
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        )
    poisoned = case.X.clone()
    poisoned[0, 0] = float("nan")
    before = [p.detach().clone() for p in case.model.parameters()]
    closure = make_closure(optimizer, case.model, case.loss_fn, poisoned, case.y)
    with pytest.warns(RuntimeWarning, match="refused the update"):
        optimizer.step(closure)
    assert optimizer.records["global"]["skipped_steps"] == 1
    for param, value in zip(case.model.parameters(), before, strict=True):
        assert torch.equal(param, value)
    # Standalone afterwards, the trace no longer zeroes outputs for a step.
    assert all(
        extension.deferred_checks is None
        for extension in monitor.extensions(step + 1)
        if hasattr(extension, "deferred_checks")
    )
