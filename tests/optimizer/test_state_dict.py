"""Checkpointing: ``state_dict`` → ``torch.save`` → ``torch.load`` → fresh optimizer."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch

from dampednewton import (
    ConstantDamping,
    DampedNewton,
    EigenvalueThreshold,
    RelativeThreshold,
    TopK,
)
from dampednewton.diagnostics import GSNR, CurvatureTrace, DiagnosticsMonitor
from tests.cases import PROBLEMS
from tests.utils import (
    VIVIT_STEP,
    Case,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    run_steps,
    snapshot,
)

MLP_CE = PROBLEMS[0]
STEPS_BEFORE, STEPS_AFTER = 2, 3
MODES = {"exact": 0, "monte-carlo": 1}


def make_optimizer(
    case: Case, mc_samples: int, seed: int, monitor: DiagnosticsMonitor | None = None
) -> DampedNewton:
    """Three groups with the picklable built-in policies and the shorthands."""
    first, _, last = case.model
    groups = [
        {
            "params": list(first.parameters()),
            "damping": ConstantDamping(2.0),
            "criterion": TopK(3),
            "name": "input layer",
        },
        {"params": [last.weight], "lr": 0.5, "criterion": RelativeThreshold(0.01)},
        {"params": [last.bias], "criterion": EigenvalueThreshold(1e-6)},
    ]
    return DampedNewton(
        groups,
        damping=1.0,
        criterion=2,
        mc_samples=mc_samples,
        seed=seed,
        monitor=monitor,
        **VIVIT_STEP,
    )


def checkpoint(case: Case, optimizer: DampedNewton) -> dict:
    """Save model and optimizer through a buffer; load with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(
        {"model": case.model.state_dict(), "optimizer": optimizer.state_dict()}, buffer
    )
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # the default from torch 2.6 on


@pytest.mark.parametrize("mc_samples", MODES.values(), ids=MODES.keys())
def test_resumed_optimizer_continues_in_lock_step(mc_samples: int):
    original = build_case(MLP_CE)
    optimizer = make_optimizer(original, mc_samples, seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    saved = checkpoint(original, optimizer)

    resumed = build_case(MLP_CE)
    resumed.model.load_state_dict(saved["model"])
    # A different seed: only the loaded generator state can make the draws agree.
    resumed_optimizer = make_optimizer(resumed, mc_samples, seed=2)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    assert_same_state(snapshot(resumed_optimizer), snapshot(optimizer))

    run_steps(optimizer, original, STEPS_AFTER)
    run_steps(resumed_optimizer, resumed, STEPS_AFTER)

    assert_parameters_equal(
        list(resumed.model.parameters()), list(original.model.parameters())
    )
    assert_same_state(snapshot(resumed_optimizer), snapshot(optimizer))
    assert optimizer.records["global"]["step"] == STEPS_BEFORE + STEPS_AFTER
    # Every group moved in every step, so all of them were compared.
    assert [s["steps_without_direction"] for s in optimizer.records["groups"]] == [
        0
    ] * 3


def test_generator_state_matters_for_monte_carlo():
    """Control for the lock-step test: without the saved generator, MC steps differ."""
    original = build_case(MLP_CE)
    optimizer = make_optimizer(original, mc_samples=1, seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    saved = checkpoint(original, optimizer)
    del saved["optimizer"]["param_groups"][0]["dampednewton"]["generator"]

    resumed = build_case(MLP_CE)
    resumed.model.load_state_dict(saved["model"])
    resumed_optimizer = make_optimizer(resumed, mc_samples=1, seed=2)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    run_steps(optimizer, original, 1)
    run_steps(resumed_optimizer, resumed, 1)

    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            resumed.model.parameters(), original.model.parameters(), strict=True
        )
    )


@pytest.mark.parametrize("traced", [False, True], ids=["alone", "with-mc-trace"])
def test_monte_carlo_is_reproducible_from_the_seed_and_private(traced):
    """Same seed, same trajectory; the global random state is never touched.

    Also not by a monitor's Monte-Carlo trace in the optimizer's passes.
    """
    trajectories = []
    for _ in range(2):
        case = build_case(MLP_CE)
        trace = CurvatureTrace(curvature="diag_ggn_mc")
        monitor = DiagnosticsMonitor([trace], seed=0) if traced else None
        optimizer = make_optimizer(case, mc_samples=1, seed=5, monitor=monitor)
        global_state = torch.get_rng_state()
        run_steps(optimizer, case, 3)
        assert torch.equal(torch.get_rng_state(), global_state)
        trajectories.append(list(case.model.parameters()))
    assert_parameters_equal(trajectories[0], trajectories[1])


def test_loaded_state_is_not_shared_with_its_source():
    """Loading in memory copies the counters: stepping one leaves the other alone."""
    source_case, target_case = build_case(MLP_CE), build_case(MLP_CE)
    source = make_optimizer(source_case, mc_samples=1, seed=1)
    run_steps(source, source_case, 1)
    target = make_optimizer(target_case, mc_samples=1, seed=2)
    target.load_state_dict(source.state_dict())
    before = snapshot(source)

    run_steps(target, target_case, 2)

    assert_same_state(snapshot(source), before)
    assert target.records["global"]["step"] == 3


def make_optimizer_with_lambdas(case: Case, seed: int) -> DampedNewton:
    """A lambda criterion in group 1 and a local damping function in group 0."""
    first, _, last = case.model

    def local_damping(evals, gram_evecs, gammas, lambdas):
        return torch.full_like(evals, 2.0)

    groups = [
        {"params": list(first.parameters()), "damping": local_damping},
        {"params": list(last.parameters()), "criterion": lambda evals: [-1]},
    ]
    return DampedNewton(groups, damping=1.0, criterion=2, seed=seed, **VIVIT_STEP)


def test_saving_unpicklable_settings_names_group_key_and_alternatives():
    case = build_case(MLP_CE)
    optimizer = make_optimizer_with_lambdas(case, seed=1)
    run_steps(optimizer, case, 1)  # lambdas step fine

    with pytest.raises(
        pickle.PicklingError,
        match=r"(?s)parameter group 0 has damping=.*local_damping.*cannot be pickled"
        r".*use a number, ConstantDamping, LevenbergMarquardt.*module level",
    ):
        torch.save(optimizer.state_dict(), io.BytesIO())
    state = optimizer.state_dict()
    del state["param_groups"][0]["damping"]  # now the lambda is the first refusal
    with pytest.raises(
        pickle.PicklingError,
        match=r"parameter group 1 has criterion=<function .*<lambda>.*"
        r"use TopK\(k\), EigenvalueThreshold\(v\) or RelativeThreshold\(f\)",
    ):
        torch.save(state, io.BytesIO())


def test_unpicklable_settings_load_in_memory_and_continue_in_lock_step():
    original = build_case(MLP_CE)
    optimizer = make_optimizer_with_lambdas(original, seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    saved = copy.deepcopy(optimizer.state_dict())

    resumed = build_case(MLP_CE)
    resumed.model.load_state_dict(original.model.state_dict())
    # New lambdas and seed: the loaded settings and generator must take over.
    resumed_optimizer = make_optimizer_with_lambdas(resumed, seed=2)
    resumed_optimizer.load_state_dict(saved)
    for loaded, source in zip(
        resumed_optimizer.param_groups, optimizer.param_groups, strict=True
    ):
        assert loaded["criterion"] is source["criterion"]
        assert loaded["damping"] is source["damping"]

    run_steps(optimizer, original, STEPS_AFTER)
    run_steps(resumed_optimizer, resumed, STEPS_AFTER)

    assert_parameters_equal(
        list(resumed.model.parameters()), list(original.model.parameters())
    )
    assert_same_state(snapshot(resumed_optimizer), snapshot(optimizer))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("basis", ["kronecker", "gram"])
def test_a_copied_optimizer_steps_as_the_original(basis: str, how: str):
    """``copy.deepcopy``/``pickle`` of model and optimizer together: lock step.

    Monte-Carlo curvature and the Kronecker basis' steps between refreshes (step 2
    and 4 of the ramp 0, 1, 3, 7) make the generator and the kept bases matter.
    """
    original = build_case(MLP_CE)
    options = dict(VIVIT_STEP) if basis == "gram" else {}
    optimizer = DampedNewton(original.model.parameters(), seed=1, **options)
    run_steps(optimizer, original, STEPS_BEFORE)
    if how == "deepcopy":
        model, copied = copy.deepcopy((original.model, optimizer))
    else:
        model, copied = pickle.loads(pickle.dumps((original.model, optimizer)))
    twin = dataclasses.replace(original, model=model)
    run_steps(optimizer, original, STEPS_AFTER)
    run_steps(copied, twin, STEPS_AFTER)
    assert_parameters_equal(list(model.parameters()), list(original.model.parameters()))
    assert_same_state(snapshot(copied), snapshot(optimizer))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_monitored_optimizer_has_no_monitor_and_steps(how: str):
    """A monitor watches its own parameters: the copy steps without one."""
    original = build_case(MLP_CE)
    monitor = DiagnosticsMonitor([GSNR()], original.model.named_parameters())
    optimizer = DampedNewton(original.model.parameters(), seed=1, monitor=monitor)
    run_steps(optimizer, original, STEPS_BEFORE)
    if how == "deepcopy":
        model, copied = copy.deepcopy((original.model, optimizer))
    else:
        model, copied = pickle.loads(pickle.dumps((original.model, optimizer)))
    assert copied.monitor is None and optimizer.monitor is monitor
    twin = dataclasses.replace(original, model=model)
    run_steps(optimizer, original, STEPS_AFTER)
    run_steps(copied, twin, STEPS_AFTER)
    assert_parameters_equal(list(model.parameters()), list(original.model.parameters()))
    assert len(monitor.log) == STEPS_BEFORE + STEPS_AFTER


def test_a_generator_state_of_another_device_loads_with_a_warning():
    """A GPU run's checkpoint (a CUDA generator's 16-byte state) resumes on the CPU.

    Its draws go on from the seed, the same in every resume; the rest is loaded.
    """
    case = build_case(MLP_CE)
    optimizer = make_optimizer(case, mc_samples=1, seed=3)
    run_steps(optimizer, case, 2)
    saved = optimizer.state_dict()
    saved["param_groups"][0]["dampednewton"]["generator"]["generator"] = torch.zeros(
        16, dtype=torch.uint8
    )
    resumed = []
    for _ in range(2):
        twin = build_case(MLP_CE)
        twin.model.load_state_dict(case.model.state_dict())
        twin_optimizer = make_optimizer(twin, mc_samples=1, seed=0)
        with pytest.warns(RuntimeWarning, match="generator of another device"):
            twin_optimizer.load_state_dict(saved)
        assert twin_optimizer.records["global"]["step"] == 2
        run_steps(twin_optimizer, twin, 2)
        resumed.append(list(twin.model.parameters()))
    assert_parameters_equal(resumed[0], resumed[1])
