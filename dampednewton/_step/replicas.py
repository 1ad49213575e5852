"""Under data parallelism every rank must start from the same parameters.

Each rank steps its own replica by the global batch's step: replicas that start
apart (each rank seeded differently, and the gradients averaged by hand instead of
by ``DistributedDataParallel``, which copies rank 0's parameters to every rank) stay
apart silently. The first step compares a few entries of every parameter across the
ranks (no arithmetic: exact on any hardware).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dampednewton.distributed import Communicator

SAMPLES_PER_PARAMETER = 4


def check_replicas_equal(communicator: Communicator, params: Sequence[Tensor]) -> None:
    """Refuse a step whose ranks hold different parameters.

    Args:
        communicator: The ranks' collectives.
        params: Every parameter of the optimizer.

    Raises:
        RuntimeError: On every rank, if a sampled entry differs between ranks.
    """
    if not params:
        return
    samples = torch.cat([sampled_entries(p) for p in params])
    highest = communicator.max_over_ranks(samples)
    lowest = -communicator.max_over_ranks(-samples)
    if not torch.allclose(highest, lowest, rtol=0.0, atol=0.0, equal_nan=True):
        raise RuntimeError(
            "DampedNewton refused the first step: the ranks' parameters differ, so "
            "each rank would move its own replica by the global batch's step and "
            "they would stay apart. Initialize every rank's model alike (the same "
            "seed, or load the same weights), or wrap it in DistributedDataParallel, "
            "which copies rank 0's parameters to every rank."
        )


def sampled_entries(param: Tensor) -> Tensor:
    """Up to :data:`SAMPLES_PER_PARAMETER` entries of ``param``, evenly spaced."""
    flat = param.detach().reshape(-1)
    count = min(SAMPLES_PER_PARAMETER, flat.numel())
    positions = torch.linspace(0, flat.numel() - 1, count, device=flat.device)
    return flat[positions.round().long()].to(torch.float64)
