"""Bad settings at construction and in add_param_group: a clear error, no change."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    GramBasis,
    KroneckerBasis,
    NoiseAwareDamping,
)
from tests.cases import PROBLEMS
from tests.utils import (
    VIVIT_STEP,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    make_closure,
    snapshot,
)

MLP_CE = PROBLEMS[0]


@dataclass(frozen=True)
class BadConstruction:
    """Arguments of ``DampedNewton(groups, **kwargs)`` that must be refused."""

    id: str
    kwargs: dict[str, Any]
    error: type[Exception]
    match: str
    group: dict[str, Any] = field(default_factory=dict)


CONSTRUCTION_CASES = [
    BadConstruction("negative-lr", {"lr": -0.1}, ValueError, "Invalid learning rate"),
    BadConstruction("nan-lr", {"lr": math.nan}, ValueError, "Invalid learning rate"),
    BadConstruction("string-lr", {"lr": "0.1"}, TypeError, "lr must be a number"),
    BadConstruction("float-mc-samples", {"mc_samples": 1.0}, TypeError, "an int"),
    BadConstruction("string-kl-clip", {"kl_clip": "1"}, TypeError, "kl_clip"),
    BadConstruction("negative-damping", {"damping": -1.0}, ValueError, ">= 0"),
    BadConstruction("inf-damping", {"damping": math.inf}, ValueError, "finite"),
    BadConstruction("damping-string", {"damping": "lm"}, TypeError, "damping must"),
    BadConstruction("criterion-k-0", {"criterion": 0}, ValueError, "k >= 1"),
    BadConstruction("criterion-string", {"criterion": "top"}, TypeError, "int k"),
    BadConstruction("negative-mc-samples", {"mc_samples": -1}, ValueError, ">= 0"),
    BadConstruction(
        "repeated-subsampling", {"subsampling_ggn": [0, 0]}, ValueError, "repeats"
    ),
    BadConstruction("nonfinite-mode", {"nonfinite": "ignore"}, ValueError, "'skip'"),
    BadConstruction("negative-momentum", {"momentum": -0.1}, ValueError, r"\[0, 1\)"),
    BadConstruction("momentum-one", {"momentum": 1.0}, ValueError, r"\[0, 1\)"),
    BadConstruction(
        "nesterov-without-momentum",
        {"nesterov": True, "momentum": 0.0},
        ValueError,
        "momentum > 0",
    ),
    BadConstruction(
        "negative-weight-decay", {"weight_decay": -1e-4}, ValueError, ">= 0"
    ),
    BadConstruction("zero-kl-clip", {"kl_clip": 0.0}, ValueError, "kl_clip"),
    BadConstruction(
        "zero-newton-fraction", {"newton_fraction": 0.0}, ValueError, r"\(0, 1\]"
    ),
    BadConstruction(
        "newton-fraction-above-one",
        {"newton_fraction": 1.5},
        ValueError,
        "scale the whole step with lr",
    ),
    BadConstruction(
        "nan-newton-fraction", {"newton_fraction": math.nan}, ValueError, "newton"
    ),
    BadConstruction(
        "string-newton-fraction",
        {"newton_fraction": "0.3"},
        TypeError,
        "newton_fraction must be a number",
    ),
    BadConstruction("negative-complement", {"complement": -1.0}, ValueError, "> 0"),
    BadConstruction("complement-string", {"complement": "auto"}, TypeError, "None"),
    BadConstruction(
        "averaging-decay-one",
        {"averaging": {"decay": 1.0}},
        TypeError,
        "CurvatureAveraging",
    ),
    BadConstruction(
        "averaging-with-sample-statistics",
        {
            "basis": GramBasis(),
            "averaging": CurvatureAveraging(),
            "damping": NoiseAwareDamping(),
        },
        ValueError,
        "mean slopes only",
    ),
    BadConstruction(
        "kronecker-with-per-direction-damping",
        {"damping": NoiseAwareDamping()},
        ValueError,
        "one number δ",
    ),
    BadConstruction(
        "kronecker-with-subsampled-gradients",
        {},
        ValueError,
        "Leave subsampling_grad=None",
        {"subsampling_grad": [0, 1]},
    ),
    BadConstruction(
        "averaged-gram-with-subsampled-gradients",
        {"basis": GramBasis()},
        ValueError,
        "Pass averaging=None for ViViT's step",
        {"subsampling_grad": [0, 1]},
    ),
    BadConstruction("basis-string", {"basis": "kfac"}, TypeError, "basis must be"),
    BadConstruction(
        "averaging-string-in-group",
        {},
        TypeError,
        "CurvatureAveraging",
        group={"averaging": "lazy"},
    ),
    BadConstruction(
        "unknown-keyword",
        {"betas": (0.9, 0.99)},
        TypeError,
        "unexpected keyword argument 'betas'",
    ),
    BadConstruction("group-negative-lr", {}, ValueError, "learning rate", {"lr": -1}),
    BadConstruction(
        "seed-string", {"seed": "abc"}, TypeError, "seed must be an integer or None"
    ),
    BadConstruction(
        "seed-float", {"seed": 1.5}, TypeError, "seed must be an integer or None"
    ),
]


@pytest.mark.parametrize("bad", CONSTRUCTION_CASES, ids=lambda bad: bad.id)
def test_bad_construction(bad: BadConstruction):
    case = build_case(MLP_CE)
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    with pytest.raises(bad.error, match=bad.match):
        DampedNewton([{"params": params, **bad.group}], **bad.kwargs)
    assert_parameters_equal(params, values)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"decay": 1.0}, "decay < 1"),
        ({"decay": -0.1}, "0 <= decay"),
        ({"rank": 0}, "rank >= 1"),
    ],
    ids=str,
)
def test_bad_averaging_settings(settings: dict, match: str):
    with pytest.raises(ValueError, match=match):
        CurvatureAveraging(**settings)


def test_averaging_interval_of_the_wrong_type():
    """A wrong type raises TypeError (a wrong value ValueError), as for every option."""
    with pytest.raises(TypeError, match="interval >= 1"):
        CurvatureAveraging(interval=1.5)
    with pytest.raises(TypeError, match="bool ramp"):
        CurvatureAveraging(ramp=1)


def test_refresh_schedule():
    """The ramp doubles the gaps up to ``interval``; without it, every ``interval``."""
    ramped, fixed = (
        CurvatureAveraging(interval=6),
        CurvatureAveraging(interval=5, ramp=False),
    )
    assert [t for t in range(40) if ramped.refreshes(t, 1)] == [
        0,
        1,
        3,
        7,
        13,
        19,
        25,
        31,
        37,
    ]
    assert [t for t in range(12) if fixed.refreshes(t, 1)] == [0, 5, 10]
    assert fixed.refreshes(3, 0), "the first factor is always built"


@pytest.mark.parametrize("interval", [1, 2, 3, 4, 5, 8, 20, 33])
def test_the_ramp_in_closed_form_is_the_doubling_schedule(interval):
    """Gaps 1, 2, 4, … capped at ``interval``, as a loop over the steps builds them."""
    expected, refresh, gap = set(), 0, 1
    while refresh < 2000:
        expected.add(refresh)
        refresh, gap = refresh + gap, min(2 * gap, interval)
    averaging = CurvatureAveraging(interval=interval)
    assert {t for t in range(2000) if averaging.refreshes(t, 1)} == expected


def test_groups_with_differing_shared_settings_are_refused():
    case = build_case(MLP_CE)
    first, second = (list(layer.parameters()) for layer in case.model[::2])
    groups = [{"params": first}, {"params": second, "mc_samples": 0}]
    with pytest.raises(ValueError, match="'mc_samples' must be the same in all"):
        DampedNewton(groups)


ADD_GROUP_CASES = {
    "negative-lr": ({"lr": -0.5}, ValueError, "Invalid learning rate"),
    "negative-damping": ({"damping": -0.1}, ValueError, ">= 0"),
    "criterion-k-0": ({"criterion": 0}, ValueError, "k >= 1"),
    "momentum-above-one": ({"momentum": 1.5}, ValueError, "momentum"),
    "other-mc-samples": ({"mc_samples": 0}, ValueError, "'mc_samples' must be"),
    "other-subsampling-ggn": (
        {"subsampling_ggn": [0, 1]},
        ValueError,
        "'subsampling_ggn' must be",
    ),
    "other-subsampling-grad": (
        {"subsampling_grad": [2]},
        ValueError,
        "'subsampling_grad' must be",
    ),
    "subsampling-ggn-not-a-sequence": (
        {"subsampling_ggn": 4},
        TypeError,
        r"subsampling_ggn must be a sequence of sample indices \(e.g. range\(32\)\)",
    ),
    "parameter-in-two-groups": ({"first": True}, ValueError, "more than one"),
    "parameter-listed-twice": ({"twice": True}, ValueError, "twice"),
}


@pytest.mark.parametrize("bad", ADD_GROUP_CASES.values(), ids=ADD_GROUP_CASES.keys())
@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with dup")
def test_bad_add_param_group(bad: tuple[dict, type[Exception], str]):
    settings, error, match = bad
    case = build_case(MLP_CE)
    first, second = (list(layer.parameters()) for layer in case.model[::2])
    optimizer = DampedNewton(first, criterion=2, mc_samples=1, seed=0, **VIVIT_STEP)
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)
    settings = dict(settings)
    new_params = first if settings.pop("first", False) else second
    if settings.pop("twice", False):
        new_params = [*second, second[0]]

    with pytest.raises(error, match=match):
        optimizer.add_param_group({"params": new_params, **settings})

    assert len(optimizer.param_groups) == 1
    assert_same_state(snapshot(optimizer), before)
    assert_parameters_equal(params, values)


@pytest.mark.parametrize("basis", [KroneckerBasis(), GramBasis()], ids=repr)
@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with dup")
def test_a_parameter_listed_twice_is_refused(basis):
    """It would be stepped twice (the Kronecker basis registered its layer twice)."""
    case = build_case(MLP_CE)
    params = list(case.model.parameters())
    with pytest.raises(
        ValueError, match=r"group 0 lists a parameter of shape .* twice"
    ):
        DampedNewton([*params, params[0]], basis=basis)


def test_subsampling_indices_given_as_an_iterator_are_read_once():
    """Every group holds the same plain list (torch copies the default to each)."""
    case = build_case(MLP_CE)
    groups = [{"params": list(layer.parameters())} for layer in case.model[::2]]
    optimizer = DampedNewton(groups, subsampling_ggn=(i for i in range(3)))
    optimizer.add_param_group({"params": [], "subsampling_ggn": iter([0, 1, 2])})
    assert [g["subsampling_ggn"] for g in optimizer.param_groups] == [[0, 1, 2]] * 3
