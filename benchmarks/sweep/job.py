"""One benchmark job: train one (problem, optimizer, hyperparameters, seed).

The job never raises for a failing run: divergence (see
:func:`benchmarks.sweep.training.train` for the rule) and exceptions are recorded in
``result.json`` (``status`` ``"diverged"`` with the ``divergence`` reason, or
``"failed"`` with the error message) so that a sweep continues with its next job.
"""

from __future__ import annotations

import math
import platform
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from benchmarks.measure import (
    PeakMemory,
    Stopwatch,
    resolve_device,
    resolve_dtype,
)
from benchmarks.problems.problems import Problem, build_problem
from benchmarks.sweep.checkpointing import CHECKPOINT_FILE, Checkpointing
from benchmarks.sweep.config_dict import config_dict
from benchmarks.sweep.data_parallel import (
    join_process_group,
    launched_rank,
    launched_world_size,
    local_device,
)
from benchmarks.sweep.grid import select_grid_point, skip_reason
from benchmarks.sweep.result import FinalMetrics, RunResult, StepTime
from benchmarks.sweep.resume import finished_result
from benchmarks.sweep.schedules import lr_scheduler
from benchmarks.sweep.training import OptimizerNeeds, mini_batches, train

DATA_PARALLEL_HINT = (
    " [rank {rank} of {world_size} under torchrun: a collective fails when another "
    "rank ended (raised) or did not reach it within data_parallel.timeout_s="
    "{timeout} s; the other ranks' errors are in torchrun's output]"
)


DEFAULT_THREADS = torch.get_num_threads()
"""torch's thread count when the benchmarks were imported (``num_threads: null``)."""


def hyperparameters(optimizer_cfg: DictConfig) -> dict[str, Any]:
    """Settings of the optimizer node, flattened with dotted keys.

    ``_target_``/``_partial_`` are dropped; nested nodes (e.g. a damping policy)
    contribute ``"damping.value"``-style keys and ``"damping._target_"``.

    Args:
        optimizer_cfg: The ``optimizer`` node.

    Returns:
        Flat mapping of setting name to value.
    """
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if not prefix and key in ("_target_", "_partial_"):
                continue
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{name}.")
            else:
                flat[name] = value

    walk(OmegaConf.to_container(optimizer_cfg, resolve=True), "")
    return flat


def _seeds(seed: int) -> tuple[int, int]:
    """Independent seeds for the model initialization and the batch order."""
    model_seed, batch_seed = np.random.SeedSequence(seed).generate_state(2)
    return int(model_seed), int(batch_seed)


def _build_optimizer(cfg: DictConfig, problem: Problem) -> torch.optim.Optimizer:
    """Instantiate the partial optimizer config on the trainable parameters."""
    factory = instantiate(cfg.optimizer)
    if isinstance(factory, torch.optim.Optimizer) or not callable(factory):
        raise TypeError(
            "The optimizer config must be a partial: add `_partial_: true` next to "
            "its `_target_`, so that it is called with the model's parameters."
        )
    return factory(problem.trainable_parameters())


def _communication_seconds(optimizer: torch.optim.Optimizer) -> float | None:
    """Seconds the optimizer spent in collectives so far (``None``: not counted)."""
    return getattr(optimizer, "communication_seconds", None)


def _train_from_config(cfg: DictConfig, result: RunResult, output_dir: Path) -> None:
    """Build everything from the config, train, and record into ``result``."""
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    data_parallel = join_process_group(device, cfg.data_parallel.timeout_s)
    if data_parallel is not None:
        device = local_device(device)
        data_parallel.check_batch_size(cfg.problem.batch_size)
        result.world_size = data_parallel.world_size
    # null: torch's default, also after an earlier job of the multirun set another.
    torch.set_num_threads(
        DEFAULT_THREADS if cfg.num_threads is None else cfg.num_threads
    )
    needs = OptimizerNeeds(**config_dict(cfg.optimizer_needs))
    memory = PeakMemory(device)
    # The global RNG drives third-party randomness (BackPACK's Monte-Carlo GGN,
    # AdaHessian's probes); our own draws use the generators below.
    torch.manual_seed(cfg.seed)
    model_seed, batch_seed = _seeds(cfg.seed)
    problem = build_problem(
        cfg.problem, device, dtype, torch.Generator().manual_seed(model_seed)
    )
    if needs.backpack:
        from backpack import extend

        problem.model = extend(problem.model)
        problem.loss_fn = extend(problem.loss_fn)
    optimizer = _build_optimizer(cfg, problem)
    scheduler = lr_scheduler(
        cfg.get("lr_schedule"),
        optimizer,
        problem.protocol.steps,
        cfg.lr_schedule_horizon,
    )
    batches = mini_batches(
        problem.data.x_train.shape[0],
        problem.protocol.batch_size,
        torch.Generator().manual_seed(batch_seed),
        device,
    )
    communication_start = _communication_seconds(optimizer)
    checkpointing = None
    if cfg.get("checkpoint_every") is not None:
        checkpointing = Checkpointing(
            output_dir, cfg.checkpoint_every, _config_container(cfg)
        )
    log = train(
        problem,
        optimizer,
        needs,
        batches,
        Stopwatch(device),
        data_parallel,
        checkpointing,
        scheduler,
    )
    communication_end = _communication_seconds(optimizer)
    curves = log.curves
    maximize = problem.protocol.maximize
    finite = [m for m in curves.test_metric if math.isfinite(m)]
    final = FinalMetrics()
    if not log.diverged:
        final = FinalMetrics(
            curves.train_loss[-1], curves.test_loss[-1], curves.test_metric[-1]
        )
    result.status = "diverged" if log.diverged else "ok"
    result.metric = problem.protocol.metric
    result.maximize = maximize
    result.targets = list(problem.protocol.targets)
    result.curves = curves
    result.final = final
    result.best_test_metric = (max if maximize else min)(finite) if finite else None
    result.steps_to_target = log.steps_to_target
    result.time_to_target = log.time_to_target
    result.steps_taken = len(log.step_times)
    result.resumed_from_step = log.resumed_from_step
    result.train_time = sum(log.step_times)
    result.step_time = StepTime(
        log.median_step_time(cfg.timing.warmup_steps), cfg.timing.warmup_steps
    )
    result.memory = memory.read()
    result.divergence = log.divergence
    result.at_chance_level = log.at_chance_level
    result.device = str(device)
    result.device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    result.num_threads = torch.get_num_threads()
    result.torch_version = torch.__version__
    result.num_parameters = sum(p.numel() for p in problem.trainable_parameters())
    if data_parallel is not None and communication_end is not None and log.step_times:
        result.communication_per_step = (
            communication_end - (communication_start or 0.0)
        ) / len(log.step_times)


def _config_container(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, resolved when possible."""
    try:
        return config_dict(cfg, resolve=True)
    except Exception:  # an unresolvable interpolation is itself worth recording
        return config_dict(cfg, resolve=False)


def run_job(
    cfg: DictConfig, output_dir: Path, overrides: Sequence[str] = ()
) -> RunResult:
    """Run one job and write ``result.json`` into ``output_dir``, unless it is done.

    A job whose complete result an earlier run of the same sweep left in
    ``output_dir`` (same overrides and config, not failed) is not run again: its
    stored record is returned (see :mod:`benchmarks.sweep.resume`).

    Under ``torchrun`` (see :mod:`benchmarks.sweep.data_parallel`) every rank trains and
    only rank 0 writes. There a failed job ends the process (``SystemExit``, after
    rank 0 wrote its result): the other ranks wait for this one in a collective,
    so it must not go on to a sweep's next job; its exit makes their collectives
    fail ("Connection closed by peer") and ``torchrun`` stop them. A rank that
    hangs instead makes the others fail after ``data_parallel.timeout_s``.

    Args:
        cfg: The composed job config (its ``optimizer`` node receives the grid point).
        output_dir: The Hydra job directory.
        overrides: The Hydra job's overrides (recorded, and checked on a rerun).

    Returns:
        The job's record (also for the progress callback), with ``job_dir`` set.
    """
    result = RunResult(
        cfg.problem.name, cfg.optimizer_name, cfg.seed, overrides=list(overrides)
    )
    try:
        reason = skip_reason(cfg)
        point = None if reason else select_grid_point(cfg)
        done = finished_result(output_dir, _config_container(cfg), overrides)
        if done is not None:
            return done
        if point is None:
            result.status = "skipped"
            result.skip_reason = reason or "grid_point beyond this optimizer's grid"
        else:
            result.grid_point = point
            result.hyperparameters = hyperparameters(cfg.optimizer)
            if cfg.get("lr_schedule") is not None:
                result.hyperparameters["lr_schedule"] = cfg.lr_schedule
                if cfg.lr_schedule == "inverse_sqrt":
                    result.hyperparameters["lr_schedule_horizon"] = (
                        cfg.lr_schedule_horizon
                    )
            _train_from_config(cfg, result, output_dir)
    except Exception as err:
        result.status = "failed"
        result.error = f"{type(err).__name__}: {err}"
        if launched_world_size() > 1:
            result.error += DATA_PARALLEL_HINT.format(
                rank=launched_rank(),
                world_size=launched_world_size(),
                timeout=cfg.data_parallel.timeout_s,
            )
        result.traceback = traceback.format_exc()
    result.config = _config_container(cfg)
    if launched_rank() == 0:
        result.write(output_dir)
        if result.status != "failed":  # a rerun of a failed job resumes from it
            (output_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
    if result.status == "failed" and launched_world_size() > 1:
        raise SystemExit(
            f"rank {launched_rank()} of {launched_world_size()}: the job failed "
            f"({result.error}); this process ends so that every rank stops (a "
            "multirun under torchrun ends at its first failed job)."
        )
    return result
