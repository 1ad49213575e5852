"""A benchmark job data-parallel under ``torchrun``: process group, shards, rank 0.

``torchrun --nproc-per-node K -m benchmarks.run ...`` starts K copies of the job.
Each builds the same problem (same seeds), wraps the model in
``DistributedDataParallel`` and trains on its contiguous shard of every global batch
(the config's batch size, divisible by K); every rank evaluates identically, and only
rank 0 writes ``result.json``. Without ``torchrun``'s environment nothing changes.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

T = TypeVar("T")


def launched_rank() -> int:
    """This process's rank as ``torchrun`` set it (``0`` without ``torchrun``)."""
    return int(os.environ.get("RANK", "0"))


def launched_world_size() -> int:
    """Number of processes ``torchrun`` started (``1`` without ``torchrun``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the data-parallel job.

    Attributes:
        rank: Its rank.
        world_size: Number of processes.
    """

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        """Check the rank.

        Raises:
            ValueError: Unless ``0 <= rank < world_size``.
        """
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must lie in [0, world_size={self.world_size}), got {self.rank}."
            )

    def check_batch_size(self, batch_size: int) -> int:
        """The local batch size of a global batch of ``batch_size``.

        Args:
            batch_size: The global batch size (the problem's ``batch_size``).

        Returns:
            Samples per rank.

        Raises:
            ValueError: If ``batch_size`` is not divisible by the world size.
        """
        if batch_size % self.world_size:
            raise ValueError(
                f"problem.batch_size={batch_size} is the global batch size under "
                f"torchrun and must be divisible by the world size {self.world_size} "
                "(every rank takes an equal shard)."
            )
        return batch_size // self.world_size

    def shard(self, index: Tensor) -> Tensor:
        """This rank's contiguous shard of a global batch.

        Args:
            index: The global batch's sample indices (length divisible by the world
                size, see :meth:`check_batch_size`).

        Returns:
            The indices of this rank, in rank order of the global batch.
        """
        local = self.check_batch_size(index.shape[0])
        return index[self.rank * local : (self.rank + 1) * local]

    def mean(self, value: float) -> float:
        """The mean of a number over the ranks (e.g. the global batch's loss).

        Args:
            value: This rank's number.

        Returns:
            The mean, identical on every rank.
        """
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return total.item() / self.world_size

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The model wrapped in ``DistributedDataParallel`` (averages gradients).

        Args:
            model: The (BackPACK-extended) model; the optimizer keeps its parameters.
            device: The job's device.

        Returns:
            The wrapper to train through.
        """
        device_ids = None if device.type == "cpu" else [device]
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def join_process_group(
    device: torch.device, timeout_seconds: float
) -> DataParallel | None:
    """Join ``torchrun``'s process group (gloo on CPU, NCCL on CUDA), if launched so.

    The group stays initialized for the process's later jobs; ``benchmarks.run``
    destroys it at exit.

    Args:
        device: The job's device.
        timeout_seconds: How long a rank waits for the others in a collective
            before it raises (``data_parallel.timeout_s``): a rank that hangs
            makes the others fail after that long, not wait forever.

    Returns:
        This process's place; ``None`` without ``torchrun``'s environment or with
        one process.
    """
    if launched_world_size() == 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo" if device.type == "cpu" else "nccl",
            timeout=timedelta(seconds=timeout_seconds),
        )
    return DataParallel(dist.get_rank(), dist.get_world_size())


def local_device(device: torch.device) -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` for CUDA under ``torchrun``.

    Args:
        device: The job's device.

    Returns:
        The device to train on.
    """
    if device.type != "cuda" or "LOCAL_RANK" not in os.environ:
        return device
    return torch.device("cuda", int(os.environ["LOCAL_RANK"]))


def broadcast_from_rank_0(value: T) -> T:
    """Rank 0's ``value`` (any picklable object) on every rank of the joined group.

    Args:
        value: This rank's value (ignored except on rank 0).

    Returns:
        Rank 0's value.
    """
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def in_process_group() -> bool:
    """Whether this process joined a process group (a job ran data-parallel)."""
    return dist.is_available() and dist.is_initialized()


def leave_process_group(*, completed: bool) -> None:
    """Destroy the process group if this process joined one.

    Args:
        completed: Whether this rank's job completed. Then the ranks first meet at a
            barrier, which also waits for their pending collectives: a rank that
            tears its group down early closes connections that another rank still
            reads from (gloo aborts that process). A failed rank leaves at once.
    """
    if in_process_group():
        if completed:
            dist.barrier()
        gc.collect()  # DDP's reducer (a reference cycle) dies before its group
        dist.destroy_process_group()
