"""Per-optimizer hyperparameter grids of the sweep presets.

Hydra's basic sweeper takes Cartesian products, but learning-rate (and damping) grids
differ between optimizers. A sweep preset therefore lists, per optimizer name, the
candidate values of some optimizer settings (``grid.<optimizer_name>.<key>: [...]``)
and sweeps ``grid_point`` over ``range(P)``: job ``grid_point = i`` uses the ``i``-th
point of the product of its optimizer's lists (keys in the order written). With the
same number of points for every optimizer, every optimizer gets the same tuning budget;
jobs whose index exceeds their optimizer's grid are skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from benchmarks.sweep.config_dict import config_dict

_MISSING = object()


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """All points of a grid, the product of its value lists (first key slowest).

    Args:
        grid: Setting name → candidate values (each a non-empty list).

    Returns:
        One dict per point.

    Raises:
        ValueError: If a value list is empty or not a list.
    """
    for key, values in grid.items():
        if isinstance(values, str) or not isinstance(values, Sequence) or not values:
            raise ValueError(
                f"Grid entry {key!r} must be a non-empty list of values, "
                f"got {values!r}."
            )
    keys = list(grid)
    return [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(grid[key] for key in keys))
    ]


def skip_reason(cfg: DictConfig) -> str | None:
    """Why the job is not to run, before its grid point is known.

    A damping rule other than ``constant`` (``conf/damping/``) on an optimizer that
    takes none (``takes_damping_rules: false``) or not this one (a list of the rules
    it takes): a sweep crossing optimizers with damping rules skips those jobs.

    Args:
        cfg: The job config.

    Returns:
        The reason, or ``None`` when the job is to run.
    """
    rule, takes = cfg.damping_rule, cfg.takes_damping_rules
    if rule == "constant":
        return None
    if not takes or (not isinstance(takes, bool) and rule not in takes):
        target = OmegaConf.select(cfg, "optimizer._target_")
        basis = OmegaConf.select(cfg, "optimizer.basis._target_")
        return f"damping={rule} does not apply to {target}" + (
            f" with {basis}" if takes else ""
        )
    return None


def grid_size(cfg: DictConfig) -> int | None:
    """Number of points of the job's optimizer's grid (``None``: no grid for it).

    Args:
        cfg: The job config.

    Returns:
        The number of points.
    """
    if cfg.grid is None or cfg.optimizer_name not in cfg.grid:
        return None
    return len(grid_points(config_dict(cfg.grid[cfg.optimizer_name], resolve=True)))


def select_grid_point(cfg: DictConfig) -> dict[str, Any] | None:
    """Write the job's grid point into ``cfg.optimizer``.

    Args:
        cfg: The job config (modified in place).

    Returns:
        The applied point (``{}`` without a grid), or ``None`` when ``grid_point`` is
        beyond this optimizer's grid (the job is to be skipped).

    Raises:
        ValueError: If the grid and ``grid_point`` are inconsistent.
        KeyError: If a grid key is not a setting of the optimizer config.
    """
    if cfg.grid is None:
        return {}
    name = cfg.optimizer_name
    if cfg.grid_point is None:
        raise ValueError(
            "The config has a grid but grid_point is null; sweep grid_point over "
            "range(number of points), e.g. grid_point=range(4)."
        )
    if name not in cfg.grid:
        raise ValueError(
            f"The sweep's grid has no entry for optimizer {name!r} (entries: "
            f"{sorted(cfg.grid)}); add grid.{name} to the sweep preset."
        )
    grid = config_dict(cfg.grid[name], resolve=True)
    points = grid_points(grid)
    if not 0 <= cfg.grid_point:
        raise ValueError(f"grid_point must be >= 0, got {cfg.grid_point}.")
    if cfg.grid_point >= len(points):
        return None
    point = points[cfg.grid_point]
    for key, value in point.items():
        if OmegaConf.select(cfg.optimizer, key, default=_MISSING) is _MISSING:
            raise KeyError(
                f"grid.{name}.{key} is not a setting of the optimizer config "
                f"{cfg.optimizer.get('_target_')}; settings: {sorted(cfg.optimizer)}."
            )
        OmegaConf.update(cfg.optimizer, key, value, merge=False)
    return point
