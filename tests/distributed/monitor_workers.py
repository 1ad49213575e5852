"""Spawned ranks of the monitor's distributed tests and their single-process reference.

Every rank trains the float64 model of :mod:`tests.distributed.workers` on its shard
of one global batch, with a :class:`DiagnosticsMonitor` standalone (SGD) or as
``DampedNewton``'s monitor, and saves the monitor's log to ``<out>/<rank>.pt``; the
reference runs the same on the concatenated batches in one process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from backpack import backpack, extend
from backpack.extensions import DiagGGNMC
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from dampednewton import DampedNewton, GramBasis
from dampednewton.backpack.seeding import SeededGenerator, drawing_from
from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsMonitor,
    FixedRange,
    GradientHistogram,
    GradientParameterHistogram,
    NoiseScale,
)
from tests.distributed.spawning import process_group
from tests.distributed.workers import LOCAL_BATCH, global_batch, make_model


@dataclass(frozen=True)
class MonitorJob:
    """What every rank runs.

    Attributes:
        model: ``'mlp'`` or ``'cnn'``.
        steps: Steps to take (the second bins the network histogram in the first's
            ranges).
        ddp: Wrap the model in ``DistributedDataParallel`` (else average the
            gradients by hand, then finish the record again).
        in_optimizer: The monitor is ``DampedNewton``'s (else standalone, with SGD).
        monte_carlo: Add a Monte-Carlo trace (its draws differ per rank).
        options: ``DampedNewton``'s keyword arguments besides the defaults here (a
            damping with per-sample statistics makes the step's engine compute
            individual gradients too).
    """

    model: str = "mlp"
    steps: int = 2
    ddp: bool = True
    in_optimizer: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    monte_carlo: bool = False


MONTE_CARLO_SEED = 3
MONTE_CARLO_SAMPLES = 2


def diagnostics(monte_carlo: bool = False) -> list:
    """Every diagnostic the monitor offers, both histogram semantics, exact traces.

    The ranges that follow the data are symmetric, so their gradient axes take odd
    numbers of bins: with an even number an edge is zero up to the last bit of the
    range, and the CNN's many exactly-zero individual gradients (dead ReLUs: 519 of
    952 at the first step) would fall on either side of it with the summation order.
    """
    return [
        GSNR(),
        NoiseScale(),
        GradientHistogram(bins=7),
        GradientHistogram(bins=7, semantics="cockpit", label="hist_cockpit"),
        GradientHistogram(bins=8, range_policy=FixedRange(-0.2, 0.2), label="fixed"),
        GradientParameterHistogram(bins=(5, 5)),
        GradientParameterHistogram(
            bins=(5, 5), semantics="cockpit", label="hist2d_cockpit"
        ),
        CurvatureTrace(),
        CurvatureTrace(curvature="diag_h"),
    ] + (
        [CurvatureTrace(curvature="diag_ggn_mc", mc_samples=MONTE_CARLO_SAMPLES)]
        if monte_carlo
        else []
    )


def run_rank(
    rank: int, world_size: int, init_file: str, out: str, job: MonitorJob
) -> None:
    """One rank of a job; saves the monitor's records and bytes received."""
    torch.set_num_threads(1)
    with process_group(rank, world_size, init_file):
        results = monitored(job, world_size, rank)
        results["refuses_other_group"] = job.in_optimizer and _refuses_other_group(
            world_size
        )
        torch.save(results, os.path.join(out, f"{rank}.pt"))
        # No rank tears the groups down while another still connects the new one.
        dist.barrier()


def monitored(job: MonitorJob, world_size: int, rank: int | None) -> dict[str, Any]:
    """Train with the monitor on rank ``rank``'s shard (``None``: the whole batch).

    Returns:
        ``"records"``: the monitor's log; ``"bytes"``: bytes it received.
    """
    model = make_model(job.model)
    distributed = rank is not None
    stepped: nn.Module = (
        DistributedDataParallel(model) if distributed and job.ddp else model
    )
    monitor = DiagnosticsMonitor(
        diagnostics(job.monte_carlo), model.named_parameters(), seed=MONTE_CARLO_SEED
    )
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer: torch.optim.Optimizer
    if job.in_optimizer:
        settings = {
            "basis": GramBasis(),
            "lr": 0.5,
            "damping": 0.1,
            "criterion": 5,
            "mc_samples": 0,
        }
        optimizer = DampedNewton(
            model.parameters(),
            **{**settings, **job.options},
            seed=0,
            monitor=monitor,
        )
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    average_by_hand = distributed and not job.ddp
    sharded: list[dict[str, float]] = []
    for step in range(job.steps):
        inputs, labels = global_batch(job.model, world_size, step)
        if job.monte_carlo and not distributed:
            sharded.append(sharded_traces(model, loss_fn, inputs, labels, step))
        if rank is not None:
            rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            inputs, labels = inputs[rows], labels[rows]
        forward = _loss(stepped, loss_fn, inputs, labels)
        if job.in_optimizer:
            optimizer.step(_closure(optimizer, forward, model, average_by_hand))
            continue
        optimizer.zero_grad()
        loss = forward()
        with monitor.backward_context(step, loss):
            loss.backward()
        if average_by_hand:  # .grad becomes the global mean only now
            _average_gradients(model)
            monitor.finish(step, loss=loss)
        optimizer.step()
    return {
        "records": list(monitor.log),
        "bytes": monitor.communication_bytes,
        "sharded_traces": sharded,
    }


def sharded_traces(
    model: nn.Module, loss_fn: nn.Module, inputs: Tensor, labels: Tensor, step: int
) -> dict[str, float]:
    """The ranks' mean Monte-Carlo trace of a step, each shard drawn as its rank does.

    BackPACK's ``DiagGGNMC`` on each rank's shard, sampling from the monitor's
    generator reseeded for that rank and step, then the mean over the ranks (each
    trace is of its shard's mean loss).
    """
    world_size = inputs.shape[0] // LOCAL_BATCH
    traces: dict[str, float] = {}
    for rank in range(world_size):
        rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        model.zero_grad()
        generator = SeededGenerator(MONTE_CARLO_SEED).for_rank(
            torch.device("cpu"), rank, step
        )
        with drawing_from(generator), backpack(DiagGGNMC(MONTE_CARLO_SAMPLES)):
            loss_fn(model(inputs[rows]), labels[rows]).backward()
        for name, param in model.named_parameters():
            key = f"diag_ggn_mc/trace/{name}"
            share = param.diag_ggn_mc.sum().item() / world_size
            traces[key] = traces.get(key, 0.0) + share
            del param.diag_ggn_mc
    model.zero_grad()
    traces["diag_ggn_mc/trace"] = sum(traces.values())
    return traces


def _refuses_other_group(world_size: int) -> bool:
    """Whether ``DampedNewton`` refuses a monitor of another process group."""
    group = dist.new_group(list(range(world_size)))
    monitor = DiagnosticsMonitor([GSNR()], process_group=group)
    try:
        DampedNewton(make_model("mlp").parameters(), monitor=monitor)
    except ValueError:
        return True
    return False


def _loss(model, loss_fn, inputs: Tensor, labels: Tensor) -> Callable[[], Tensor]:
    return lambda: loss_fn(model(inputs), labels)


def _closure(optimizer, forward, model, average_by_hand: bool):
    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = forward()
        loss.backward()
        if average_by_hand:
            _average_gradients(model)
        return loss

    return closure


def _average_gradients(model: nn.Module) -> None:
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
