"""The sweep plan: the basic sweeper's jobs expanded without Hydra's internals."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import open_dict

from benchmarks.sweep.sweep_plan import SweepPlan, expand_sweep

CONF = Path(__file__).resolve().parents[2] / "conf"


def hydra_values(text: str) -> list[str]:
    """Hydra's own expansion of one sweep value (the reference)."""
    (override,) = OverridesParser.create().parse_overrides([f"key={text}"])
    if not override.is_sweep_override():
        return [override.get_value_element_as_str()]
    return [str(v) for v in override.sweep_string_iterator()]


def test_every_preset_expands_as_hydra_parses_it(compose_config, sweep_name):
    params = compose_config(
        [f"+sweep={sweep_name}"], return_hydra_config=True
    ).hydra.sweeper.params
    jobs = expand_sweep(params, [f"+sweep={sweep_name}"])
    axes = [[f"{k}={v}" for v in hydra_values(str(t))] for k, t in params.items()]
    expected = [[*job, f"+sweep={sweep_name}"] for job in itertools.product(*axes)]
    assert jobs == expected


def test_command_line_overrides_replace_a_parameter_in_its_place():
    params = {"optimizer": "sgd,adam", "seed": "range(3)"}
    jobs = expand_sweep(params, ["+sweep=x", "seed=0,5", "problem.steps=6"])
    assert jobs == [
        ["optimizer=sgd", "seed=0", "+sweep=x", "problem.steps=6"],
        ["optimizer=sgd", "seed=5", "+sweep=x", "problem.steps=6"],
        ["optimizer=adam", "seed=0", "+sweep=x", "problem.steps=6"],
        ["optimizer=adam", "seed=5", "+sweep=x", "problem.steps=6"],
    ]
    assert expand_sweep({"grid_point": "range(1, 7, 3)"}, []) == [
        ["grid_point=1"],
        ["grid_point=4"],
    ]
    assert expand_sweep({}, ["problem.targets=[0.5,0.9]", "x={a: 1, b: 2},[1]"]) == [
        ["problem.targets=[0.5,0.9]", "x={a: 1, b: 2}"],
        ["problem.targets=[0.5,0.9]", "x=[1]"],
    ]


@pytest.mark.parametrize(
    "override",
    ["optimizer=glob(*)", "x=choice(1,2)", "a='b,c'", "lr=${x}"],
)
def test_forms_not_parsed_here_give_no_plan(override):
    assert expand_sweep({}, [override]) is None


def test_plan_of_a_sweep_crossing_optimizers_and_damping_rules():
    overrides = ["+sweep=noisy_quadratic_damping"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = compose("config", overrides=overrides, return_hydra_config=True)
        with open_dict(config):
            config.hydra.overrides.task = overrides
        plan = SweepPlan.of(config)
    assert len(plan.kinds) == 2 * 4 * 4 * 5
    names = [plan.names.get(kind) for kind in plan.kinds]
    assert names.count(None) == 3 * 4 * 5, "sgd takes no damping rule"
    rules = ("", "_noise", "_gsnr", "_lm")
    for name in ("sgd", *(f"dampednewton_gram{s}" for s in rules)):
        assert names.count(f"{name} on noisy_quadratic") == 4 * 5
    assert plan.describe().startswith("160 jobs (20 sgd on noisy_quadratic, ")
    assert ", 60 skipped: a damping rule they do not take): about " in plan.describe()


def test_plan_skips_the_grid_points_beyond_a_grid():
    overrides = ["+sweep=damping"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = compose("config", overrides=overrides, return_hydra_config=True)
        with open_dict(config):  # as the command line's sweep over grid_point
            config.hydra.overrides.task = [*overrides, "grid_point=range(12)"]
        plan = SweepPlan.of(config)
    assert len(plan.kinds) == 2 * 12 * 3
    running = [kind for kind in plan.kinds if kind not in plan.skipped]
    assert len(running) == 2 * 10 * 3, "each optimizer's grid has 10 points"
    assert plan.describe().startswith(
        "72 jobs (30 dampednewton on digits_mlp, 30 dampednewton_vivit on digits_mlp, "
        "12 skipped: grid_point beyond their optimizer's grid): about "
    )
