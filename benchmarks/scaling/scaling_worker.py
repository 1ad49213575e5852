"""One rank of a scaling measurement: data-parallel steps of several optimizers.

Every rank joins a gloo group (1 thread), builds the same model, wraps it in
``DistributedDataParallel`` with a comm hook that counts its gradient buckets, and
takes warm-up and timed steps on its contiguous shard of every global batch. Rank 0
writes the per-optimizer :class:`Measurement` list as JSON.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from benchmarks.scaling.communication_model import all_reduce_bytes
from benchmarks.sweep.training import mini_batches

#: Optimizers a scaling run can measure: DampedNewton's Gram basis with each GGN, its
#: Kronecker basis (the default, Monte-Carlo) and two baselines.
VARIANTS = ("mc1", "exact", "kronecker", "sgd", "adam")


@dataclass(frozen=True)
class ScalingJob:
    """What every rank of one scaling run does.

    Attributes:
        model: The model builder's keyword arguments (Hydra node, ``_target_``
            included) of the problem config.
        x_train: Training inputs (float32).
        y_train: Training labels.
        world_size: Number of ranks.
        global_batch: Samples per step over all ranks (divisible by the world size).
        warmup_steps: Untimed steps first.
        timed_steps: Timed steps.
        variants: Entries of :data:`VARIANTS`.
        timeout_seconds: Timeout of the process group's collectives.
    """

    model: dict[str, Any]
    x_train: Tensor
    y_train: Tensor
    world_size: int
    global_batch: int
    warmup_steps: int
    timed_steps: int
    variants: tuple[str, ...]
    timeout_seconds: float = 120.0

    def __post_init__(self) -> None:
        """Check the settings.

        Raises:
            ValueError: For an unknown variant, no timed step, or a global batch
                not divisible by the world size.
        """
        unknown = set(self.variants) - set(VARIANTS)
        if unknown:
            raise ValueError(f"Unknown variants {sorted(unknown)}; choose {VARIANTS}.")
        if self.timed_steps < 1 or self.warmup_steps < 0:
            raise ValueError("Need timed_steps >= 1 and warmup_steps >= 0.")
        if self.global_batch % self.world_size:
            raise ValueError(
                f"The global batch {self.global_batch} must be divisible by the "
                f"world size {self.world_size}."
            )


@dataclass(frozen=True)
class Measurement:
    """Per-step numbers of one optimizer on rank 0 (timed steps only).

    Attributes:
        variant: The entry of :data:`VARIANTS`.
        seconds: Median wall-clock seconds per step.
        communication_seconds: DampedNewton's seconds in its collectives per step
            (``None`` for the baselines).
        communication_bytes: Bytes rank 0 received per step in DampedNewton's
            collectives (``None`` for the baselines).
        ddp_bytes: Bytes rank 0 received per step in DDP's gradient all-reduce:
            the measured buckets' sizes times the ring's ``2 (R − 1) / R``.
        ddp_buckets: DDP's all-reduces per step.
    """

    variant: str
    seconds: float
    communication_seconds: float | None
    communication_bytes: float | None
    ddp_bytes: float
    ddp_buckets: float


class BucketCounter:
    """State of the counting comm hook: bytes and buckets all-reduced so far."""

    def __init__(self) -> None:
        """Start at zero."""
        self.bytes = 0
        self.buckets = 0


# Unannotated bucket and return: DDP checks the annotations against the classes
# themselves, and this module's postponed annotations are strings.
def _counting_allreduce(counter: BucketCounter, bucket):
    """DDP's default all-reduce (a ``dist.GradBucket``), counting its size first."""
    buffer = bucket.buffer()
    counter.bytes += buffer.numel() * buffer.element_size()
    counter.buckets += 1
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]


def _optimizer(variant: str, model: nn.Module) -> torch.optim.Optimizer:
    """The variant's optimizer with the package's / torch's defaults."""
    if variant == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if variant == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    from dampednewton import CurvatureAveraging, DampedNewton, GramBasis

    # Constant damping: Levenberg-Marquardt's extra closure call would add a forward
    # and backward pass (and DDP's all-reduce) on its adaptation steps. Every step a
    # refresh: the table measures a refresh's bytes (steps between refreshes only
    # all-reduce the gradient, as DDP does, and agree on the loss); the amortized cost
    # is that times the refresh schedule's fraction of steps.
    if variant == "kronecker":
        return DampedNewton(
            model.parameters(), averaging=CurvatureAveraging(decay=0.95, interval=1)
        )
    return DampedNewton(
        model.parameters(),
        basis=GramBasis(),
        damping=0.1,
        mc_samples=1 if variant == "mc1" else 0,
        averaging=CurvatureAveraging(interval=1),
    )


def _communication(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """DampedNewton's seconds and bytes in its collectives so far (0 for others)."""
    return (
        getattr(optimizer, "communication_seconds", 0.0),
        getattr(optimizer, "communication_bytes", 0.0),
    )


def _step(
    model: nn.Module,
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Tensor,
    labels: Tensor,
) -> None:
    """One optimizer step through ``step(closure)``."""

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        return loss

    # torch's stub types closures as returning float; they may return the loss.
    optimizer.step(closure)  # type: ignore[arg-type]


def measure_variant(job: ScalingJob, variant: str, rank: int) -> Measurement:
    """Warm-up and timed steps of one optimizer on this rank's shards.

    Args:
        job: The run.
        variant: Which optimizer.
        rank: This rank.

    Returns:
        This rank's per-step numbers.
    """
    from backpack import extend
    from hydra.utils import instantiate

    is_newton = variant in ("mc1", "exact", "kronecker")
    model = instantiate(job.model, generator=torch.Generator().manual_seed(0))
    loss_fn = nn.CrossEntropyLoss()
    if is_newton:
        model, loss_fn = extend(model), extend(loss_fn)
    wrapped = nn.parallel.DistributedDataParallel(model)
    counter = BucketCounter()
    wrapped.register_comm_hook(counter, _counting_allreduce)
    optimizer = _optimizer(variant, model)
    batches = mini_batches(
        job.x_train.shape[0],
        job.global_batch,
        torch.Generator().manual_seed(1),
        torch.device("cpu"),
    )
    local = job.global_batch // job.world_size
    times: list[float] = []
    start_seconds = start_bytes = 0.0
    start_ddp = (0, 0)
    for step in range(job.warmup_steps + job.timed_steps):
        if step == job.warmup_steps:
            start_seconds, start_bytes = _communication(optimizer)
            start_ddp = (counter.bytes, counter.buckets)
        index = next(batches)[rank * local : (rank + 1) * local]
        begin = time.perf_counter()
        _step(wrapped, loss_fn, optimizer, job.x_train[index], job.y_train[index])
        if step >= job.warmup_steps:
            times.append(time.perf_counter() - begin)
    steps = job.timed_steps
    end_seconds, end_bytes = _communication(optimizer)
    return Measurement(
        variant=variant,
        seconds=statistics.median(times),
        communication_seconds=(
            (end_seconds - start_seconds) / steps if is_newton else None
        ),
        communication_bytes=(end_bytes - start_bytes) / steps if is_newton else None,
        ddp_bytes=all_reduce_bytes(job.world_size, counter.bytes - start_ddp[0])
        / steps,
        ddp_buckets=(counter.buckets - start_ddp[1]) / steps,
    )


def run_rank(rank: int, job: ScalingJob, init_method: str, output: str) -> None:
    """Entry point of a spawned rank (``torch.multiprocessing.spawn``).

    Args:
        rank: This rank (spawn's first argument).
        job: The run.
        init_method: The group's rendezvous (``file://…``).
        output: Where rank 0 writes the measurements (JSON).
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=job.world_size,
        timeout=timedelta(seconds=job.timeout_seconds),
    )
    try:
        measurements = [measure_variant(job, v, rank) for v in job.variants]
        if rank == 0:
            Path(output).write_text(json.dumps([asdict(m) for m in measurements]))
        # Pending collectives end on every rank before any rank closes its group.
        dist.barrier()
    finally:
        # The DDP wrappers sit in reference cycles: their reducers hold the group and
        # the counting hook's futures. Free them now, not at interpreter teardown,
        # where gloo's threads would meet a finalizing interpreter and abort.
        gc.collect()
        dist.destroy_process_group()
