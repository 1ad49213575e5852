"""Spawned ranks of the distributed tests and their single-process references.

Every worker joins a gloo group through a ``file://`` rendezvous, trains a float64
model on its shard of one global batch (rank ``r`` gets rows ``r·N … (r+1)·N−1``) and
saves what the test compares to ``<out>/<rank>.pt``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from backpack import extend
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import dampednewton.backpack.global_batch
from dampednewton import DampedNewton, GramBasis, LevenbergMarquardt, NoiseAwareDamping
from dampednewton.backpack.seeding import SeededGenerator
from dampednewton.math import sampling as sampling_functions
from dampednewton.math.sampling import sampled_cross_entropy_gradients
from dampednewton.math.traffic import Route
from tests.distributed.spawning import process_group, spawn_ranks

LOCAL_BATCH = 4
SEED = 0
EVERY_RANK = -1
"""``Job.fault_rank`` of a fault on every rank."""


@dataclass(frozen=True)
class Job:
    """What every rank runs.

    Attributes:
        model: ``'mlp'``, ``'cnn'`` or ``'mlp-bce'`` (multi-label binary
            cross-entropy; the exact GGN: the Monte-Carlo draws aligned with one
            process are the cross-entropy's).
        steps: Steps to take.
        options: Keyword arguments of :class:`DampedNewton` besides the defaults here.
        ddp: Wrap the model in ``DistributedDataParallel`` (else average gradients in
            the closure by hand).
        ddp_options: Keyword arguments of ``DistributedDataParallel``.
        nan_rank: Rank whose inputs are NaN at step ``nan_step`` (``None``: none).
        nan_step: See ``nan_rank``.
        resume_at: Save on rank 0 after this many steps, load on every rank into a
            fresh model and optimizer, and step on from both (``None``: no resume).
        route: Gather every structured layer by this route (a
            :class:`~dampednewton.math.traffic.Route` value; ``None``: the cheaper).
        micro_batches: Sizes of the micro-batches that split each rank's batch
            (gradient accumulation, each loss weighted by its share ``N_m/N``);
            empty: one backward pass.
        fault_rank: Rank whose closure goes wrong at step ``fault_step`` (``None``:
            none; :data:`EVERY_RANK`: all): ``fault`` is ``'raise'`` (after its
            backward pass), ``'short'`` (a local batch one sample short),
            ``'skip'`` (the closure returns ``None`` without a backward pass, as
            Lightning's skipped batch) or ``'twice'`` (an extra forward pass of the
            model with gradients before the closure's own, whose output it drops).
        fault_step: See ``fault_rank``.
        fault: See ``fault_rank``.
        apart: Rank 1's model starts from other parameters (each rank seeded
            differently by mistake).
    """

    model: str = "mlp"
    steps: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    ddp: bool = False
    ddp_options: dict[str, Any] = field(default_factory=dict)
    nan_rank: int | None = None
    nan_step: int = 1
    resume_at: int | None = None
    route: str | None = None
    micro_batches: tuple[int, ...] = ()
    fault_rank: int | None = None
    fault_step: int = 1
    fault: str = "raise"
    apart: bool = False


def make_model(name: str) -> nn.Module:
    """The same float64 model on every rank (seed 0)."""
    torch.manual_seed(0)
    if name in ("mlp", "mlp-bce"):
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    else:
        model = nn.Sequential(
            nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)
        )
    return extend(model.double())


def global_batch(name: str, world_size: int, step: int) -> tuple[Tensor, Tensor]:
    """The global batch of a step: inputs and class labels.

    ``'mlp-bce'``: three soft binary labels per sample (multi-label).
    """
    generator = torch.Generator().manual_seed(100 + step)
    shape = (1, 6, 6) if name == "cnn" else (5,)
    size = world_size * LOCAL_BATCH
    inputs = torch.randn(size, *shape, generator=generator, dtype=torch.float64)
    if name == "mlp-bce":
        return inputs, torch.rand(size, 3, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(3, (size,), generator=generator)


def make_loss(name: str) -> nn.Module:
    """The model's loss: cross-entropy, or the binary one for ``'mlp-bce'``."""
    return extend(
        nn.BCEWithLogitsLoss() if name == "mlp-bce" else nn.CrossEntropyLoss()
    )


def make_optimizer(model: nn.Module, options: dict[str, Any]) -> DampedNewton:
    """The optimizer of every rank and of the reference."""
    settings: dict[str, Any] = {
        "basis": GramBasis(),  # the suite's own jobs; KroneckerBasis() as an option
        "lr": 0.5,
        "damping": 0.1,
        "criterion": 5,
        "mc_samples": 0,
        "seed": SEED,
        "momentum": 0.5,
    }
    settings.update(options)
    if settings.get("damping") == "lm":
        settings["damping"] = LevenbergMarquardt(0.1)
    if settings.get("damping") == "noise":  # needs per-sample gradients
        settings["damping"] = NoiseAwareDamping(0.1, 0.5)
    return DampedNewton(model.parameters(), **settings)


def reference(job: Job, world_size: int) -> list[Tensor]:
    """Parameters after each step of one process on the concatenated batches.

    Its Monte-Carlo labels are the ranks' (:func:`per_rank_draws`).
    """
    model = make_model(job.model)
    optimizer = make_optimizer(model, _global_options(job.options, world_size))
    loss_fn = make_loss(job.model)
    history = []
    for step in range(job.steps):
        inputs, labels = global_batch(job.model, world_size, step)

        def closure(inputs: Tensor = inputs, labels: Tensor = labels) -> Tensor:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), labels)
            loss.backward()
            return loss

        binary = job.model == "mlp-bce"
        sampling = (
            "sampled_binary_cross_entropy_gradients"
            if binary
            else ("sampled_cross_entropy_gradients")
        )
        draws = per_rank_draws(
            job.options.get("seed", SEED),
            world_size,
            step,
            job.micro_batches,
            getattr(sampling_functions, sampling),
        )
        # BackPACK's pass draws in loss_derivatives, the autograd pass (a refresh
        # after the first) in sampled_roots
        with (
            mock.patch(f"dampednewton.backpack.loss_derivatives.{sampling}", draws),
            mock.patch(f"dampednewton.backpack.sampled_roots.{sampling}", draws),
        ):
            optimizer.step(closure)
        history.append(_flat(model))
    return history


def per_rank_draws(
    seed: int,
    world_size: int,
    step: int,
    micro_batches: tuple[int, ...] = (),
    sampled: Callable[..., Tensor] = sampled_cross_entropy_gradients,
) -> Callable[..., Tensor]:
    """A loss's Monte-Carlo gradients of one step as the ranks draw them.

    Each rank's (equal) slice of the global batch's logits draws with ``sampled``
    (the cross-entropy's or the binary cross-entropy's sampling) from that rank's
    generator of the step, seeded from ``(seed, rank, step)``, one micro-batch
    after the other.
    """

    def draws(logits: Tensor, mc_samples: int, generator: Any = None) -> Tensor:
        parts = logits.split(logits.shape[0] // world_size)
        drawn = []
        for rank, part in enumerate(parts):
            rank_generator = SeededGenerator(seed).for_rank(part.device, rank, step)
            drawn.extend(
                sampled(micro, mc_samples, rank_generator)
                for micro in part.split(list(micro_batches or (len(part),)))
            )
        return torch.cat(drawn, dim=1)

    return draws


def _global_options(options: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Local sub-sampling indices of every rank as indices into the global batch."""
    shifted = {
        name: [
            index + rank * LOCAL_BATCH for rank in range(world_size) for index in local
        ]
        for name in ("subsampling_ggn", "subsampling_grad")
        if (local := options.get(name)) is not None
    }
    return {**options, **shifted}


def assert_matches_reference(
    ranks: list[dict[str, Any]], job: Job, world_size: int
) -> None:
    """Every rank's parameters after every step equal the reference's (float64)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference(job, world_size)
    for rank in ranks:
        for step, params in enumerate(rank["history"]):
            torch.testing.assert_close(
                params, expected[step], rtol=1e-10, atol=1e-12, msg=f"step {step}"
            )


def spawn(job: Job, world_size: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Run the job on ``world_size`` spawned ranks; what each saved, by rank."""
    return spawn_ranks(run_rank, job, world_size, tmp_path)


def run_rank(rank: int, world_size: int, init_file: str, out: str, job: Job) -> None:
    """One rank of a job; saves parameters, losses and states per step."""
    torch.set_num_threads(1)
    if job.route is not None:
        forced = Route(job.route)
        dampednewton.backpack.global_batch.cheaper_route = lambda shapes: forced
    with process_group(rank, world_size, init_file):
        results = _train(rank, world_size, job, Path(out))
        torch.save(results, os.path.join(out, f"{rank}.pt"))
        dist.barrier()  # no rank closes its group while another still reads from it


def _train(rank: int, world_size: int, job: Job, out: Path) -> dict[str, Any]:
    model = make_model(job.model)
    if job.apart and rank == 1:
        with torch.no_grad():
            next(model.parameters())[0] += 1e-3
    stepped: nn.Module = (
        DistributedDataParallel(model, **job.ddp_options) if job.ddp else model
    )
    optimizer = make_optimizer(model, job.options)
    loss_fn = make_loss(job.model)
    initial = _flat(model)
    history, losses, skipped, sent, errors = [], [], [], [], []
    resumed: tuple[nn.Module, DampedNewton] | None = None
    resumed_history = []
    for step in range(job.steps):
        inputs, labels = _local(job, world_size, rank, step)
        if job.resume_at is not None and step == job.resume_at:
            resumed = _resume(rank, job, out, model, optimizer)
        faulty = job.fault_rank in (rank, EVERY_RANK) and step == job.fault_step
        if faulty and job.fault == "short":
            inputs, labels = inputs[1:], labels[1:]
        closure = _closure(stepped, optimizer, loss_fn, inputs, labels, job)
        if faulty and job.fault == "raise":
            closure = _raising_after(closure)
        if faulty and job.fault == "skip":
            closure = _skipping(optimizer)
        if faulty and job.fault == "twice":
            closure = _forward_first(stepped, inputs, closure)
        try:
            losses.append(optimizer.step(closure))
            errors.append(None)
        except (RuntimeError, ValueError, FloatingPointError) as error:
            losses.append(None)
            errors.append(f"{type(error).__name__}: {error}")
        skipped.append(optimizer.records["global"]["skipped_steps"])
        sent.append(optimizer.communication_bytes)
        history.append(_flat(model))
        if resumed is not None:
            twin, twin_optimizer = resumed
            twin_optimizer.step(
                _closure(twin, twin_optimizer, loss_fn, inputs, labels, job)
            )
            resumed_history.append(_flat(twin))
    return {
        "history": history,
        "losses": losses,
        "skipped": skipped,
        "resumed": resumed_history,
        "communication_bytes": sent,
        "errors": errors,
        "initial": initial,
        "autograd_refreshes": optimizer._pipeline.kronecker._passes.autograd,
    }


def _forward_first(
    model: nn.Module, inputs: Tensor, closure: Callable[[], Tensor]
) -> Callable[[], Tensor]:
    """The closure after a forward pass of the model whose output is dropped."""

    def twice() -> Tensor:
        model(inputs)
        return closure()

    return twice


def _skipping(optimizer: DampedNewton) -> Callable[[], None]:
    """A closure that skips its batch: gradients zeroed, no forward, ``None``."""

    def skipping() -> None:
        optimizer.zero_grad()

    return skipping


def run_created_before_init(
    rank: int, world_size: int, init_file: str, out: str, job: Job
) -> None:
    """The optimizer created before ``init_process_group``: its first step's error."""
    torch.set_num_threads(1)
    model = make_model(job.model)
    optimizer = make_optimizer(model, job.options)
    with process_group(rank, world_size, init_file):
        inputs, labels = _local(job, world_size, rank, 0)
        closure = _closure(model, optimizer, make_loss(job.model), inputs, labels, job)
        before = _flat(model)
        try:
            optimizer.step(closure)
            error = None
        except RuntimeError as raised:
            error = str(raised)
        result = {"error": error, "unchanged": torch.equal(before, _flat(model))}
        torch.save(result, os.path.join(out, f"{rank}.pt"))
        dist.barrier()


def _raising_after(closure: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """The closure, raising after its backward pass (and the gradients' average)."""

    def raising() -> Tensor:
        closure()
        raise RuntimeError("the closure failed after backward")

    return raising


def _local(job: Job, world_size: int, rank: int, step: int) -> tuple[Tensor, Tensor]:
    inputs, labels = global_batch(job.model, world_size, step)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    inputs, labels = inputs[rows].clone(), labels[rows]
    if rank == job.nan_rank and step == job.nan_step:
        inputs[0] = torch.nan
    return inputs, labels


def _closure(model, optimizer, loss_fn, inputs, labels, job):
    def closure() -> Tensor:
        optimizer.zero_grad()
        if job.micro_batches:
            loss = _accumulate(model, loss_fn, inputs, labels, job)
        else:
            loss = loss_fn(model(inputs), labels)
            loss.backward()
        if not job.ddp:  # replicated by hand: average the gradients ourselves
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        return loss

    return closure


def _accumulate(model, loss_fn, inputs, labels, job) -> Tensor:
    """Backward passes of the micro-batches, each loss weighted by its share.

    Under DDP, every pass but the last skips the all-reduce (``no_sync``).
    """
    total = torch.zeros((), dtype=inputs.dtype)
    sizes = list(job.micro_batches)
    for number, rows in enumerate(torch.arange(len(inputs)).split(sizes), start=1):
        last = number == len(sizes)
        with contextlib.nullcontext() if last or not job.ddp else model.no_sync():
            loss = loss_fn(model(inputs[rows]), labels[rows]) * len(rows) / len(inputs)
            loss.backward()
        total = total + loss.detach()
    return total


def _resume(rank, job, out, model, optimizer):
    """Rank 0 saves; every rank loads into a fresh model and optimizer."""
    path = out / "checkpoint.pt"
    if rank == 0:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path
        )
    dist.barrier()
    checkpoint = torch.load(path, weights_only=False)
    twin = make_model(job.model)
    twin.load_state_dict(checkpoint["model"])
    twin_optimizer = make_optimizer(twin, {**job.options, "seed": 12345})
    twin_optimizer.load_state_dict(checkpoint["optimizer"])
    return twin, twin_optimizer


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
