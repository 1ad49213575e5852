"""The global batch of a monitor under data parallelism: what the reducers exchange.

Under ``torch.distributed`` each rank's backward pass sees its local batch of ``N``
samples; the monitor records the diagnostics of the global batch (the ranks' local
batches concatenated, ``R·N`` samples), identically on every rank. The reducers
exchange small sufficient statistics through :class:`Ranks` (a
:class:`~dampednewton.distributed.Communicator`), never individual gradients:

* GSNR and noise scale: BackPACK's ``sum_grad_squared = Σ_n (g_n/N)²`` of the local
  mean loss, so the global one is ``(1/R²) Σ_r`` of the ranks' (an all-reduce of one
  number per parameter element); the mean gradient ``ḡ`` is ``.grad``, already the
  global batch's (``DistributedDataParallel`` averages it).
* Histograms of individual gradients ``N·grad_batch = ∇ℓ_n`` (no rescaling): the
  ranks agree on each range from the maximum of their largest magnitudes, then add up
  their counts.
* Curvature traces of the local mean loss: ``(1/R) Σ_r`` of the ranks' traces.

For one process, :data:`SINGLE_PROCESS` exchanges nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from dampednewton.diagnostics.bin_adaptation import (
    RangePolicy,
    largest_finite_magnitude,
    range_of_largest_magnitude,
)


class Ranks(Protocol):
    """The collectives a reducer needs (a ``Communicator``, or one process)."""

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    def sum_over_ranks(self, tensor: Tensor) -> Tensor:
        """The elementwise sum of every rank's ``tensor``."""
        ...

    def max_over_ranks(self, tensor: Tensor) -> Tensor:
        """The elementwise maximum of every rank's ``tensor``."""
        ...

    def stack_over_ranks(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension."""
        ...


class SingleProcess:
    """One process: every collective returns its input."""

    world_size = 1

    def sum_over_ranks(self, tensor: Tensor) -> Tensor:
        """Return ``tensor``."""
        return tensor

    def max_over_ranks(self, tensor: Tensor) -> Tensor:
        """Return ``tensor``."""
        return tensor

    def stack_over_ranks(self, tensor: Tensor) -> Tensor:
        """Return ``tensor`` with a leading dimension of one."""
        return tensor.unsqueeze(0)


SINGLE_PROCESS = SingleProcess()
"""The ranks of a monitor outside ``torch.distributed``."""


def global_batch(
    ranks: Ranks, batch_size: int, loss: Tensor | float | None
) -> tuple[int, float | None]:
    """The global batch size and the ranks' mean loss (if given).

    Args:
        ranks: The ranks.
        batch_size: This rank's batch size.
        loss: This rank's loss, or ``None`` (on every rank).

    Returns:
        The sum of the batch sizes and the mean of the losses.

    Raises:
        RuntimeError: If the ranks' batch sizes differ.
    """
    local = math.nan
    if loss is not None:
        local = float(loss.detach() if isinstance(loss, Tensor) else loss)
    if ranks.world_size == 1:
        return batch_size, None if loss is None else local
    table = ranks.stack_over_ranks(
        torch.tensor([float(batch_size), local], dtype=torch.float64)
    )
    sizes = [int(size) for size in table[:, 0].tolist()]
    if len(set(sizes)) > 1:
        raise RuntimeError(
            f"The diagnostics of the global batch need equal local batch sizes, got "
            f"{sizes} by rank: the mean gradient that DistributedDataParallel averages "
            "is the global batch's only then. Use drop_last=True in the "
            "DistributedSampler's DataLoader."
        )
    mean_loss = None if loss is None else float(table[:, 1].mean())
    return sum(sizes), mean_loss


def summed_over_ranks(tensors: Sequence[Tensor], ranks: Ranks) -> list[Tensor]:
    """Each tensor summed over the ranks, all in one collective.

    Args:
        tensors: Tensors of one dtype and device, the same shapes on every rank.
        ranks: The ranks.

    Returns:
        The sums, shaped like ``tensors`` (the tensors themselves for one process).
    """
    if ranks.world_size == 1 or not tensors:
        return list(tensors)
    flat = ranks.sum_over_ranks(torch.cat([t.reshape(-1) for t in tensors]))
    parts = flat.split([t.numel() for t in tensors])
    return [part.view_as(t) for part, t in zip(parts, tensors, strict=True)]


def check_agreeable(policies: Sequence[RangePolicy]) -> None:
    """Check that the ranks can agree on the policies' ranges by their magnitudes.

    Args:
        policies: Range policies.

    Raises:
        ValueError: For a :class:`PercentileRange` (it needs every rank's values).
    """
    for policy in policies:
        range_of_largest_magnitude(policy, 0.0)


def agreed_ranges(
    policies: Sequence[RangePolicy],
    values: Sequence[Sequence[Tensor]],
    ranks: Ranks,
) -> list[tuple[tuple[float, float], ...]]:
    """Histogram ranges of the global batch: one per axis of each parameter.

    Args:
        policies: The range policy of each axis (:class:`FixedRange` or
            :class:`MaxAbsRange`).
        values: Per parameter, this rank's values along each axis.
        ranks: The ranks.

    Returns:
        Per parameter, ``policy.compute`` of every rank's values concatenated.

    Raises:
        ValueError: For a :class:`PercentileRange` (it needs every rank's values).
    """
    check_agreeable(policies)
    local = torch.tensor(
        [[largest_finite_magnitude(axis) for axis in axes] for axes in values],
        dtype=torch.float64,
    )
    largest = ranks.max_over_ranks(local).tolist()
    return [
        tuple(
            range_of_largest_magnitude(policy, magnitude)
            for policy, magnitude in zip(policies, magnitudes, strict=True)
        )
        for magnitudes in largest
    ]
