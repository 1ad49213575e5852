"""``optimizer.state`` per parameter only: its idioms and torch.distributed.checkpoint.

The step counters and group statistics live in ``optimizer.records``; a state dict
carries them in its param groups, which ``torch.distributed.checkpoint`` keeps.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from dampednewton import DampedNewton, GramBasis, KroneckerBasis, NoiseFilter
from dampednewton._step.checkpoint import StateDictError
from tests.cases import PROBLEMS
from tests.utils import (
    Case,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    run_steps,
    snapshot,
)

MLP_CE = PROBLEMS[0]
STEPS_BEFORE, STEPS_AFTER = 3, 5  # the Kronecker ramp refreshes at 0, 1, 3 and 7
BASES = {"kronecker": {}, "gram": {"basis": GramBasis()}}


def make_optimizer(case: Case, basis: str, seed: int) -> DampedNewton:
    return DampedNewton(case.model.parameters(), seed=seed, **BASES[basis])


def twin_of(case: Case) -> Case:
    """The same problem with a fresh model of other initial weights."""
    twin = build_case(MLP_CE)
    with torch.no_grad():
        for param in twin.model.parameters():
            param.add_(1.0)
    return twin


def assert_lock_step(original: Case, optimizer: DampedNewton, twin: Case, copy_):
    run_steps(optimizer, original, STEPS_AFTER)
    run_steps(copy_, twin, STEPS_AFTER)
    assert_parameters_equal(
        list(twin.model.parameters()), list(original.model.parameters())
    )
    assert_same_state(snapshot(copy_), snapshot(optimizer))


@pytest.mark.parametrize("basis", BASES)
def test_state_holds_one_dict_of_tensors_per_parameter(basis: str):
    case = build_case(MLP_CE)
    optimizer = make_optimizer(case, basis, seed=1)
    params = list(case.model.parameters())
    # Before the first step too (torch.distributed.checkpoint reads an empty state
    # as one to initialize by a step without a closure).
    assert set(optimizer.state) == set(params)
    run_steps(optimizer, case, STEPS_BEFORE)
    assert set(optimizer.state) == set(params)
    for entry in optimizer.state.values():  # the idiom that moves a state by hand
        assert all(isinstance(value, torch.Tensor) for value in entry.values())
    assert optimizer.records["global"]["step"] == STEPS_BEFORE
    saved = optimizer.state_dict()
    assert set(saved["state"]) <= set(range(len(params)))
    assert saved["param_groups"][0]["dampednewton"]["global"]["step"] == STEPS_BEFORE


def test_a_group_added_later_has_state_entries_and_statistics():
    case = build_case(MLP_CE)
    first, _, last = case.model
    optimizer = DampedNewton(first.parameters(), seed=1)
    run_steps(optimizer, case, 1)
    optimizer.add_param_group({"params": list(last.parameters())})
    assert set(optimizer.state) == set(case.model.parameters())
    assert len(optimizer.records["groups"]) == 2
    run_steps(optimizer, case, 2)
    assert optimizer.records["groups"][1]["kronecker_layers"] == ((0, 1),)


@pytest.mark.parametrize("basis", BASES)
def test_distributed_checkpoint_state_dict_functions_resume_in_lock_step(basis: str):
    """``get_optimizer_state_dict`` → ``set_optimizer_state_dict`` (names as keys)."""
    original = build_case(MLP_CE)
    optimizer = make_optimizer(original, basis, seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    saved = get_optimizer_state_dict(original.model, optimizer)
    assert set(saved["state"]) <= {n for n, _ in original.model.named_parameters()}

    twin = twin_of(original)
    twin.model.load_state_dict(original.model.state_dict())
    # A different seed: only the loaded generator makes the Monte-Carlo draws agree.
    resumed = make_optimizer(twin, basis, seed=2)
    set_optimizer_state_dict(twin.model, resumed, saved)
    assert_same_state(snapshot(resumed), snapshot(optimizer))
    assert_lock_step(original, optimizer, twin, resumed)


def test_distributed_checkpoint_save_and_load_resume_in_lock_step(tmp_path):
    """``dcp.save`` and ``dcp.load`` into a template of an optimizer that stepped once.

    ``dcp.load`` fills the keys and shapes the template has; one step gives the
    Kronecker basis' template the state's structure (what torch's step with zero
    gradients does for Adam). The Gram basis' averaged factor grows with the steps,
    so its template would need as many (docs/usage.md).
    """
    basis = "kronecker"
    original = build_case(MLP_CE)
    optimizer = make_optimizer(original, basis, seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    with warnings.catch_warnings():  # "no process group: saving on one process"
        warnings.simplefilter("ignore", UserWarning)
        model_state, optimizer_state = get_state_dict(original.model, optimizer)
        dcp.save(
            {"model": model_state, "optim": optimizer_state}, checkpoint_id=tmp_path
        )

        twin = twin_of(original)
        resumed = make_optimizer(twin, basis, seed=2)
        run_steps(resumed, twin, 1)  # its state's structure: dcp.load fills it
        model_state, optimizer_state = get_state_dict(twin.model, resumed)
        template = {"model": model_state, "optim": optimizer_state}
        dcp.load(template, checkpoint_id=tmp_path)
        set_state_dict(
            twin.model,
            resumed,
            model_state_dict=template["model"],
            optim_state_dict=template["optim"],
        )
    assert_same_state(snapshot(resumed), snapshot(optimizer))
    assert_lock_step(original, optimizer, twin, resumed)


def test_a_template_of_an_optimizer_that_never_stepped_is_refused(tmp_path):
    """It would load the counters but not the state: refused, nothing changes."""
    original = build_case(MLP_CE)
    optimizer = make_optimizer(original, "kronecker", seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"optim": get_optimizer_state_dict(original.model, optimizer)},
            checkpoint_id=tmp_path,
        )
        twin = twin_of(original)
        fresh = make_optimizer(twin, "kronecker", seed=2)
        template = {"optim": get_optimizer_state_dict(twin.model, fresh)}
        dcp.load(template, checkpoint_id=tmp_path)
        before = snapshot(fresh)
        with pytest.raises(StateDictError, match="take one step before building"):
            set_optimizer_state_dict(twin.model, fresh, template["optim"])
    assert_same_state(snapshot(fresh), before)


@pytest.mark.parametrize("basis", BASES)
def test_a_state_dict_of_the_earlier_layout_loads_and_resumes(basis: str):
    """Earlier versions kept the records in ``state`` and the generator on top."""
    original = build_case(MLP_CE)
    optimizer = make_optimizer(original, basis, seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    saved = snapshot(optimizer)
    records = [group.pop("dampednewton") for group in saved["param_groups"]]
    saved["state"]["global"] = records[0]["global"]
    saved["state"]["groups"] = [entry["group"] for entry in records]
    saved["dampednewton"] = records[0]["generator"]

    twin = twin_of(original)
    twin.model.load_state_dict(original.model.state_dict())
    resumed = make_optimizer(twin, basis, seed=2)
    resumed.load_state_dict(saved)
    assert_same_state(snapshot(resumed), snapshot(optimizer))
    assert_lock_step(original, optimizer, twin, resumed)


@pytest.mark.parametrize(
    "options",
    [{}, {"basis": KroneckerBasis(noise_filter=NoiseFilter())}, BASES["gram"]],
    ids=["kronecker", "noise-filter", "gram"],
)
def test_state_tensors_replaced_by_copies_change_no_step(options):
    """The idiom that moves a state by hand: the cached bases are read again."""
    original, twin = build_case(MLP_CE), build_case(MLP_CE)
    optimizer = DampedNewton(original.model.parameters(), seed=1, **options)
    copied = DampedNewton(twin.model.parameters(), seed=1, **options)
    run_steps(optimizer, original, STEPS_BEFORE)
    run_steps(copied, twin, STEPS_BEFORE)
    for entry in copied.state.values():
        for key, value in entry.items():
            entry[key] = value.clone()
    assert_lock_step(original, optimizer, twin, copied)


@pytest.mark.parametrize(
    ("basis", "frozen"),
    [("gram", "bias"), ("kronecker", "layer")],
    ids=["gram-frozen-bias", "kronecker-frozen-layer"],
)
def test_state_that_distributed_checkpoint_leaves_out_is_refused(basis, frozen):
    """It leaves out parameters that do not require gradients; their curvature too.

    Frozen just before the checkpoint: the records still hold their curvature (a
    layer frozen at a refresh drops it, and its momentum buffer cannot be checked:
    docs/usage.md).
    """
    original = build_case(MLP_CE)
    optimizer = make_optimizer(original, basis, seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    first = original.model[0]
    (first.bias if frozen == "bias" else first).requires_grad_(False)
    saved = get_optimizer_state_dict(original.model, optimizer)

    twin = twin_of(original)
    (twin.model[0].bias if frozen == "bias" else twin.model[0]).requires_grad_(False)
    resumed = make_optimizer(twin, basis, seed=2)
    before = snapshot(resumed)
    with pytest.raises(StateDictError, match="leaves out the state of parameters"):
        set_optimizer_state_dict(twin.model, resumed, saved)
    assert_same_state(snapshot(resumed), before)


@pytest.mark.parametrize(
    ("basis", "momentum"),
    [("gram", 0.0), ("kronecker", 0.0)],
    ids=["gram", "kronecker"],
)
def test_the_state_of_a_model_of_other_shapes_is_refused(basis, momentum):
    """Without momentum buffers too: the curvature's shapes name the other model."""
    case = build_case(MLP_CE)
    optimizer = DampedNewton(
        case.model.parameters(), seed=1, momentum=momentum, **BASES[basis]
    )
    run_steps(optimizer, case, STEPS_BEFORE)
    other = torch.nn.Sequential(
        torch.nn.Linear(4, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)
    )
    target = DampedNewton(other.parameters(), momentum=momentum, **BASES[basis])
    before = snapshot(target)
    with pytest.raises(StateDictError, match="another model"):
        target.load_state_dict(optimizer.state_dict())
    assert_same_state(snapshot(target), before)


def test_the_earlier_layouts_keys_name_the_records_and_leave_no_entry():
    """``optimizer.state['global']`` was documented before: a clear KeyError."""
    case = build_case(MLP_CE)
    optimizer = make_optimizer(case, "kronecker", seed=1)
    run_steps(optimizer, case, 1)
    for copy_ in (optimizer, pickle.loads(pickle.dumps(optimizer))):
        with pytest.raises(KeyError, match=r"optimizer\.records"):
            copy_.state["global"]
        assert "global" not in copy_.state
    loaded = make_optimizer(build_case(MLP_CE), "kronecker", seed=2)
    loaded.load_state_dict(optimizer.state_dict())
    with pytest.raises(KeyError, match=r"optimizer\.records"):
        loaded.state["groups"]


def test_records_in_the_groups_win_over_a_stray_entry_of_the_earlier_layout():
    original = build_case(MLP_CE)
    optimizer = make_optimizer(original, "kronecker", seed=1)
    run_steps(optimizer, original, STEPS_BEFORE)
    saved = snapshot(optimizer)
    saved["state"]["global"] = {}  # as an earlier read of state["global"] left it
    twin = twin_of(original)
    twin.model.load_state_dict(original.model.state_dict())
    resumed = make_optimizer(twin, "kronecker", seed=2)
    resumed.load_state_dict(saved)
    assert_lock_step(original, optimizer, twin, resumed)


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
def test_state_tensors_edited_in_place_are_followed(basis):
    """A step after an in-place edit equals the step of the edited state, loaded."""
    case = build_case(MLP_CE)
    optimizer = make_optimizer(case, basis, seed=1)
    run_steps(optimizer, case, 2)  # the next step is between refreshes
    key = "kronecker_input_values" if basis == "kronecker" else "curvature_basis"
    first = next(iter(case.model.parameters()))
    optimizer.state[first][key].mul_(3.0)
    twin = twin_of(case)
    twin.model.load_state_dict(case.model.state_dict())
    loaded = make_optimizer(twin, basis, seed=2)
    loaded.load_state_dict(optimizer.state_dict())
    run_steps(optimizer, case, 1)
    run_steps(loaded, twin, 1)
    assert_parameters_equal(
        list(twin.model.parameters()), list(case.model.parameters())
    )
