"""Every config group member composes and instantiates; unknown keys are errors."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from benchmarks.measure import Stopwatch
from benchmarks.problems.data import Dataset
from benchmarks.problems.models import mlp
from benchmarks.problems.problems import METRICS, Problem, Protocol, build_problem
from benchmarks.sweep.grid import grid_points, select_grid_point, skip_reason
from benchmarks.sweep.training import OptimizerNeeds, mini_batches, train

CPU = torch.device("cpu")


def tiny_problem(steps: int) -> Problem:
    """A 4-3-2 MLP on 16 random samples (float64)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (16,), generator=gen)
    return Problem(
        name="tiny",
        model=mlp(4, [3], 2, activation="tanh", generator=gen).double(),
        loss_fn=torch.nn.CrossEntropyLoss(),
        data=Dataset(x, y, x, y),
        protocol=Protocol(
            metric="accuracy",
            targets=(),
            batch_size=8,
            steps=steps,
            eval_every=steps,
            # 3 steps on random labels test that a config runs, not that it learns:
            # only a non-finite loss counts as divergence here.
            blowup_factor=None,
            chance_margin=None,
        ),
    )


def test_root_config_defaults(compose_config):
    cfg = compose_config()
    assert cfg.problem.name == "digits_mlp"
    assert cfg.optimizer_name == "sgd"
    assert cfg.device == "auto"
    assert cfg.grid is None and cfg.grid_point is None


def _trains_tiny_model(cfg, optimizer_name):
    assert cfg.optimizer._partial_ is True, "optimizer configs must be partials"
    needs = OptimizerNeeds(**OmegaConf.to_container(cfg.optimizer_needs))
    problem = tiny_problem(steps=3)
    if needs.backpack:
        from backpack import extend

        problem.model, problem.loss_fn = extend(problem.model), extend(problem.loss_fn)
    before = [p.detach().clone() for p in problem.trainable_parameters()]
    optimizer = instantiate(cfg.optimizer)(problem.trainable_parameters())
    batches = mini_batches(16, 8, torch.Generator().manual_seed(1), CPU)
    log = train(problem, optimizer, needs, batches, Stopwatch(CPU))
    assert not log.diverged, f"{optimizer_name} diverged on the tiny problem"
    assert len(log.step_times) == 3
    moved = [
        not torch.equal(b, p)
        for b, p in zip(before, problem.trainable_parameters(), strict=True)
    ]
    assert any(moved), f"{optimizer_name} did not change any parameter in 3 steps"


def test_optimizer_config_trains_tiny_model(compose_config, optimizer_name):
    cfg = compose_config([f"optimizer={optimizer_name}"])
    assert cfg.optimizer_name == optimizer_name
    assert cfg.damping_rule == "constant" and skip_reason(cfg) is None
    _trains_tiny_model(cfg, optimizer_name)


@pytest.mark.parametrize(
    "optimizer", ["dampednewton", "dampednewton_gram", "dampednewton_vivit"]
)
def test_damping_rule_trains_tiny_model(compose_config, optimizer, damping_rule):
    cfg = compose_config([f"optimizer={optimizer}", f"damping={damping_rule}"])
    suffix = "" if damping_rule == "constant" else f"_{damping_rule}"
    assert cfg.optimizer_name == optimizer + suffix
    if optimizer == "dampednewton" and damping_rule not in ("constant", "lm"):
        # Per-direction rules need the Gram basis' eigen-directions.
        assert skip_reason(cfg) == (
            f"damping={damping_rule} does not apply to dampednewton.DampedNewton "
            "with dampednewton.KroneckerBasis"
        )
        return
    assert skip_reason(cfg) is None
    if damping_rule == "constant" and optimizer != "dampednewton_vivit":
        assert cfg.optimizer.damping is None  # the class default of the basis
    elif damping_rule == "constant":
        assert isinstance(cfg.optimizer.damping, float)
    else:
        assert cfg.optimizer.damping._target_.startswith("dampednewton.")
    _trains_tiny_model(cfg, cfg.optimizer_name)


def test_the_noise_filter_config_is_the_default_with_the_filter(compose_config):
    from dampednewton import KroneckerBasis, NoiseFilter

    cfg = compose_config(["optimizer=dampednewton_noise_filter"])
    problem = tiny_problem(steps=3)
    optimizer = instantiate(cfg.optimizer)(problem.trainable_parameters())
    (group,) = optimizer.param_groups
    assert group["basis"] == KroneckerBasis(noise_filter=NoiseFilter())
    default = compose_config(["optimizer=dampednewton"]).optimizer
    assert {k: v for k, v in cfg.optimizer.items() if k != "basis"} == {
        k: v for k, v in default.items() if k != "basis"
    }


def test_the_schedule_free_config_is_the_default_with_averaged_steps(compose_config):
    from dampednewton import CurvatureAveraging, ScheduleFree

    cfg = compose_config(["optimizer=dampednewton_schedule_free"])
    problem = tiny_problem(steps=3)
    optimizer = instantiate(cfg.optimizer)(problem.trainable_parameters())
    (group,) = optimizer.param_groups
    assert group["momentum"] == ScheduleFree(interpolation=0.9, recency=4.0)
    assert group["kl_clip"] == 1e-2
    # The defaults' schedule without the loss-triggered refreshes.
    assert group["averaging"] == CurvatureAveraging(
        decay=0.95, interval=15, loss_tolerance=None
    )
    default = compose_config(["optimizer=dampednewton"]).optimizer
    changed = ("momentum", "kl_clip", "averaging")
    assert {k: v for k, v in cfg.optimizer.items() if k not in changed} == {
        k: v for k, v in default.items() if k not in changed
    }
    averaging = dict(cfg.optimizer.averaging)
    assert averaging == {**default.averaging, "loss_tolerance": None}


@pytest.mark.parametrize(
    "name, settings",
    [
        ("dampednewton_packed", {"packed": True, "graphed": False}),
        ("dampednewton_per_layer", {"packed": False}),
    ],
)
def test_the_layout_configs_are_the_default_laid_out(compose_config, name, settings):
    from dampednewton import KroneckerBasis

    cfg = compose_config([f"optimizer={name}"])
    problem = tiny_problem(steps=3)
    optimizer = instantiate(cfg.optimizer)(problem.trainable_parameters())
    (group,) = optimizer.param_groups
    assert group["basis"] == KroneckerBasis(**settings)
    default = compose_config(["optimizer=dampednewton"]).optimizer
    assert {k: v for k, v in cfg.optimizer.items() if k != "basis"} == {
        k: v for k, v in default.items() if k != "basis"
    }


def test_damping_rule_on_an_optimizer_without_damping_is_skipped(compose_config):
    cfg = compose_config(["optimizer=sgd", "damping=lm"])
    assert cfg.optimizer_name == "sgd_lm"
    assert skip_reason(cfg) == "damping=lm does not apply to torch.optim.SGD"


@pytest.mark.slow
def test_problem_config_builds(compose_config, problem_name):
    cfg = compose_config([f"problem={problem_name}"])
    assert cfg.problem.name == problem_name
    root = cfg.problem.data.get("root")
    if root is not None and not Path(root).is_dir():
        pytest.skip(
            f"{root} missing (Debian's dataset-fashion-mnist is not installed); the "
            "IDX reader is tested on small files in test_bench_data.py"
        )
    problem = build_problem(
        cfg.problem, CPU, torch.float32, torch.Generator().manual_seed(0)
    )
    assert problem.protocol.metric in METRICS
    assert len(problem.protocol.targets) == 2, "an easier and a harder target"
    assert problem.protocol.blowup_factor == 10.0
    data = problem.data
    assert data.x_train.dtype == torch.float32
    with torch.no_grad():
        out = problem.model(data.x_test[:3])
        loss = problem.loss_fn(out, data.y_test[:3])
    if data.y_train.is_floating_point():
        assert out.shape == data.y_test[:3].shape
    else:
        num_classes = int(data.y_train.max()) + 1
        assert out.shape == (3, num_classes)
    assert torch.isfinite(loss), f"initial loss of {problem_name} is {loss}"


def _sweep_values(text: str) -> list[str]:
    """Expand a basic-sweeper value such as ``a,b`` or ``range(4)``."""
    (override,) = OverridesParser.create().parse_overrides([f"key={text}"])
    return [str(v) for v in override.sweep_string_iterator()]


@pytest.mark.slow
def test_sweep_preset_gives_optimizers_equal_valid_grids(compose_config, sweep_name):
    preset = f"+sweep={sweep_name}"
    params = compose_config([preset], return_hydra_config=True).hydra.sweeper.params
    assert {"optimizer", "grid_point", "seed"} <= set(params), params
    num_points = len(_sweep_values(params.grid_point))
    assert len(_sweep_values(params.seed)) >= 3, "report at least 3 seeds"
    rules = _sweep_values(params.damping) if "damping" in params else ["constant"]
    runs = []
    for optimizer, rule in itertools.product(_sweep_values(params.optimizer), rules):
        cfg = compose_config([preset, f"optimizer={optimizer}", f"damping={rule}"])
        if skip_reason(cfg) is not None:
            continue
        name = cfg.optimizer_name
        runs.append(name)
        points = grid_points(OmegaConf.to_container(cfg.grid[name]))
        assert len(points) == num_points, (
            f"{sweep_name}: {name} has {len(points)} grid points, the sweep runs "
            f"{num_points} (unequal tuning budget)"
        )
        for index in range(num_points):
            job = copy.deepcopy(cfg)
            job.grid_point = index
            assert select_grid_point(job) == points[index]
    grid = compose_config([preset]).grid
    assert sorted(runs) == sorted(grid), "every optimizer of the grid runs"


@pytest.mark.parametrize(
    "override",
    ["not_a_key=1", "problem.not_a_key=1", "optimizer.not_a_setting=1"],
    ids=["root", "problem", "optimizer"],
)
def test_unknown_key_is_a_clear_error(compose_config, override):
    key = override.split("=")[0]
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([override])
    message = str(info.value)
    assert f"Could not override '{key}'" in message
    assert f"+{key}=1" in message, "the error should say how to add a new key"


def test_grid_key_that_is_no_optimizer_setting_is_a_clear_error(compose_config):
    cfg = compose_config(["optimizer=sgd", "grid={sgd: {lrr: [0.1]}}", "grid_point=0"])
    with pytest.raises(KeyError, match=r"grid\.sgd\.lrr is not a setting"):
        select_grid_point(cfg)


def test_grid_without_entry_for_the_optimizer_is_a_clear_error(compose_config):
    cfg = compose_config(["optimizer=adam", "grid={sgd: {lr: [0.1]}}", "grid_point=0"])
    with pytest.raises(ValueError, match="no entry for optimizer 'adam'"):
        select_grid_point(cfg)


def test_grid_point_beyond_the_grid_means_skip(compose_config):
    cfg = compose_config(["grid={sgd: {lr: [0.1, 0.2]}}", "grid_point=2"])
    assert select_grid_point(cfg) is None
    cfg.grid_point = 1
    assert select_grid_point(cfg) == {"lr": 0.2}
    assert cfg.optimizer.lr == 0.2


def test_grid_points_are_the_product_first_key_slowest():
    points = grid_points({"lr": [1, 2], "damping": [0.1, 0.2, 0.3]})
    assert points == [
        {"lr": lr, "damping": d} for lr in (1, 2) for d in (0.1, 0.2, 0.3)
    ]
    with pytest.raises(ValueError, match="non-empty list"):
        grid_points({"lr": []})


BASELINES = ["sgd", "momentum", "adam"]
PEERS = ["soap", "kron", "muon"]  # pytorch-optimizer's


def test_make_bench_runs_every_optimizer_of_the_problem_presets(compose_config):
    cfg = compose_config(["+sweep=default"], return_hydra_config=True)
    optimizers = _sweep_values(cfg.hydra.sweeper.params.optimizer)
    assert optimizers == [*BASELINES, "dampednewton", *PEERS]
    for name in PEERS:
        (lr,) = cfg.grid[name].values()
        for low, high in itertools.pairwise(lr):
            assert high / low == pytest.approx(10**0.5, rel=0.06), f"{name}: {lr}"


@pytest.mark.parametrize(
    ("preset", "full_steps"),
    [
        ("mnist1d_mlp", 2000),
        ("mnist1d_cnn", 2000),
        ("fmnist_mlp", 4000),
        ("fmnist_2c2d", 4000),
    ],
)
def test_problem_presets_compare_the_optimizers_and_peers_on_half_decade_grids(
    compose_config, preset, full_steps
):
    cpu = compose_config([f"+sweep={preset}"], return_hydra_config=True)
    gpu = compose_config([f"+sweep=gpu_{preset}"], return_hydra_config=True)
    assert cpu.problem.name == gpu.problem.name == preset
    assert cpu.problem.steps < full_steps == gpu.problem.steps
    assert (cpu.device, gpu.device) == ("auto", "cuda")
    assert gpu.hydra.sweeper.params == cpu.hydra.sweeper.params
    assert gpu.grid == cpu.grid
    optimizers = _sweep_values(cpu.hydra.sweeper.params.optimizer)
    assert optimizers == [*BASELINES, "dampednewton", *PEERS]
    for name in optimizers:
        varied = {k: v for k, v in cpu.grid[name].items() if len(v) > 1}
        (key, values), *others = varied.items()
        assert not others and len(values) == 6, f"{name}: {varied}"
        assert key == ("damping" if name.startswith("dampednewton") else "lr")
        for low, high in itertools.pairwise(values):
            assert high / low == pytest.approx(10**0.5, rel=0.06), f"{name}: {values}"
    if preset.startswith("fmnist"):
        assert gpu.problem.batch_size == 128


def test_a_list_override_loads_from_a_weights_only_checkpoint(compose_config, tmp_path):
    """Hydra gives ListConfigs: the optimizer keeps plain lists in its groups."""
    cfg = compose_config(["optimizer=dampednewton", "optimizer.subsampling_ggn=[0,2]"])
    model = torch.nn.Linear(3, 2)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    loaded = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert loaded["param_groups"][0]["subsampling_ggn"] == [0, 2]
