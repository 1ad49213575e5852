"""Shared fixtures of the benchmark tests: config composition and config-group lists."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def _members(group: str) -> list[str]:
    """Names of the options of a config group (its YAML files)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


OPTIMIZERS = _members("optimizer")
PROBLEMS = _members("problem")
SWEEPS = _members("sweep")
DAMPINGS = _members("damping")


@pytest.fixture
def compose_config() -> Callable[..., DictConfig]:
    """Compose the root config (``conf/config.yaml``) with overrides."""

    def _compose(
        overrides: Sequence[str] = (), return_hydra_config: bool = False
    ) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        # As in a Hydra job: `${hydra:runtime.choices...}` names the optimizer.
        HydraConfig.instance().set_config(cfg)
        for key in ("optimizer_name", "damping_rule"):  # resolved while it is set
            cfg[key] = cfg[key]
        if not return_hydra_config:
            with open_dict(cfg):
                del cfg["hydra"]
        return cfg

    return _compose


@pytest.fixture(params=OPTIMIZERS)
def optimizer_name(request: pytest.FixtureRequest) -> str:
    """Every member of the ``optimizer`` config group."""
    return request.param


@pytest.fixture(params=PROBLEMS)
def problem_name(request: pytest.FixtureRequest) -> str:
    """Every member of the ``problem`` config group."""
    return request.param


@pytest.fixture(params=SWEEPS)
def sweep_name(request: pytest.FixtureRequest) -> str:
    """Every member of the ``sweep`` config group."""
    return request.param


@pytest.fixture(params=DAMPINGS)
def damping_rule(request: pytest.FixtureRequest) -> str:
    """Every member of the ``damping`` config group."""
    return request.param
