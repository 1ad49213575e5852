"""Every ``torch.distributed`` call of the optimizer: one :class:`Communicator`.

Under data parallelism each rank runs the closure's backward pass on its local batch.
The step is the one of the global batch (the ranks' batches concatenated in rank
order): the engine gathers each layer's BackPACK buffers along the sample dimension
(:meth:`Communicator.gather_samples`), the ranks agree on the mean loss and on
refusals (:meth:`Communicator.agree_on_pass`, :meth:`Communicator.refusal`), and
the Levenberg-Marquardt ratio uses the mean loss after the step
(:meth:`Communicator.mean`). Everything else is computed identically on each rank
from identical inputs; a diagnostics monitor sums, maximizes or stacks its small
statistics over the ranks (:meth:`Communicator.sum_over_ranks`,
:meth:`Communicator.max_over_ranks`, :meth:`Communicator.stack_over_ranks`, see
:mod:`dampednewton.diagnostics.ranks`). The communicator sums the
wall-clock seconds spent in its collectives (:attr:`Communicator.seconds`) and the
bytes each rank receives in them (:attr:`Communicator.bytes_received`).

The local batch sizes must be equal: the mean gradient that ``DistributedDataParallel``
averages is the global batch's mean only then.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Status of a rank's backward pass, all-gathered with the loss and batch size.
PASS_OK = 0.0
PASS_FAILED = 1.0
PASS_RETURNED_NONE = 2.0  # the closure returned None: a skipped batch
PASS_WITHOUT_FACTORS = 3.0  # its refresh's factors fell short: no rank refreshes
UNKNOWN_BATCH_SIZE = -1


@dataclass(frozen=True)
class PassAgreement:
    """What the ranks agreed on after their backward passes.

    Attributes:
        mean_loss: Mean of the ranks' losses (NaN if one is not finite).
        failed_ranks: Ranks whose backward pass raised.
        none_ranks: Ranks whose closure returned ``None`` (a skipped batch).
        world_size: Number of ranks.
        without_factors: Whether a rank's refresh pass fell short of its factors.
    """

    mean_loss: float
    failed_ranks: tuple[int, ...]
    none_ranks: tuple[int, ...]
    world_size: int
    without_factors: bool = False


class Communicator:
    """Collectives of one process group, as the optimizer needs them.

    Attributes:
        group: The ``torch.distributed`` process group.
        rank: This process's rank in the group.
        world_size: Number of processes in the group.
        seconds: Host wall-clock seconds spent in this communicator's collectives
            so far (with NCCL, a collective returns once queued: waiting for it
            is counted where its result is read, e.g. ``.item()`` in the
            agreement).
        bytes_received: Payload bytes this rank received in the collectives so
            far: ``(world_size - 1)`` times the local tensor for an all-gather or
            a broadcast to it, ``2 (world_size - 1) / world_size`` times the tensor
            for an all-reduce (a ring's traffic, the bandwidth-optimal schedule).
    """

    def __init__(self, group: dist.ProcessGroup):
        """Wrap the group.

        Args:
            group: The process group (more than one rank).
        """
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.seconds = 0.0
        self.bytes_received = 0.0
        # Ranks whose local loss of the last pass was not finite (for refusals).
        self._nonfinite_loss_ranks: tuple[int, ...] = ()
        self.without_factors = False
        """Whether a rank's refresh pass in the last agreement fell short of its
        factors (then no rank refreshes: :meth:`mean_loss_of_pass`)."""

    @contextmanager
    def _timed(self, tensor: Tensor, traffic: float) -> Iterator[None]:
        """Add the block's seconds and ``traffic`` times ``tensor``'s bytes.

        Args:
            tensor: The local tensor of the collective.
            traffic: Bytes received per byte of ``tensor``.
        """
        self.bytes_received += traffic * tensor.numel() * tensor.element_size()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    @property
    def _all_reduce_traffic(self) -> float:
        """Bytes a ring all-reduce receives per byte of its tensor."""
        return 2 * (self.world_size - 1) / self.world_size

    def gather_samples(self, tensor: Tensor, dim: int) -> Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``, in rank order.

        Args:
            tensor: This rank's tensor; the same shape on every rank (equal local
                batch sizes, checked by :meth:`agree_on_pass`).
            dim: The sample dimension.

        Returns:
            The concatenated tensor.
        """
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._timed(tensor, self.world_size - 1):
            dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def agree_on_pass(
        self,
        loss: float,
        batch_size: int,
        failed: bool,
        *,
        check_sizes: bool,
        returned_none: bool = False,
        without_factors: bool = False,
    ) -> PassAgreement:
        """All-gather the ranks' losses, batch sizes and failures of one pass.

        Args:
            loss: This rank's loss (NaN if its pass failed).
            batch_size: Its local batch size (:data:`UNKNOWN_BATCH_SIZE`: no
                BackPACK pass ran).
            failed: Whether its backward pass raised.
            check_sizes: Refuse unequal local batch sizes (when buffers will be
                gathered).
            returned_none: Whether its closure returned ``None`` (a skipped batch).
            without_factors: Whether its refresh pass fell short of its factors.

        Returns:
            The agreement.

        Raises:
            ValueError: For unequal local batch sizes with ``check_sizes``.
        """
        status = (
            PASS_FAILED
            if failed
            else PASS_RETURNED_NONE
            if returned_none
            else PASS_WITHOUT_FACTORS
            if without_factors
            else PASS_OK
        )
        local = torch.tensor([loss, float(batch_size), status], dtype=torch.float64)
        table = self.gather_samples(local.unsqueeze(0), dim=0)
        statuses = table[:, 2].tolist()
        failed_ranks = tuple(
            rank for rank, value in enumerate(statuses) if value == PASS_FAILED
        )
        none_ranks = tuple(
            rank for rank, value in enumerate(statuses) if value == PASS_RETURNED_NONE
        )
        self._nonfinite_loss_ranks = tuple(
            rank
            for rank, local_loss in enumerate(table[:, 0].tolist())
            if not math.isfinite(local_loss) and rank not in failed_ranks
        )
        sizes = {int(size) for size in table[:, 1].tolist()}
        if (
            check_sizes
            and not (failed_ranks or none_ranks)
            and len(sizes - {UNKNOWN_BATCH_SIZE}) > 1
        ):
            raise ValueError(
                "DampedNewton under torch.distributed needs the same local batch size "
                f"on every rank (got {table[:, 1].long().tolist()} by rank): the mean "
                "gradient that DistributedDataParallel averages is the global batch's "
                "mean only then. Use drop_last=True in the DistributedSampler's "
                "DataLoader."
            )
        return PassAgreement(
            mean_loss=float(table[:, 0].mean()),
            failed_ranks=failed_ranks,
            none_ranks=none_ranks,
            world_size=self.world_size,
            without_factors=PASS_WITHOUT_FACTORS in statuses,
        )

    def mean_loss_of_pass(
        self, loss: Any, batch_size: int | None, without_factors: bool = False
    ) -> Tensor | None:
        """The ranks' mean loss, once every rank's backward pass ended.

        Args:
            loss: What this rank's closure returned (NaN if its model output was
                not finite).
            batch_size: This rank's local batch size, ``None`` if no BackPACK
                pass ran (then buffers are not gathered and sizes not checked).
            without_factors: Whether this rank's refresh pass fell short of its
                factors (:attr:`without_factors` says whether any rank's did).

        Returns:
            The mean loss (NaN if one rank's loss is not finite); ``None`` when the
            closure returned ``None`` on every rank (the batch is skipped).

        Raises:
            TypeError: If the closure did not return a tensor.
            RuntimeError: If another rank's backward pass raised, or the closure
                returned ``None`` on some ranks only.
        """
        is_tensor = isinstance(loss, Tensor)
        agreement = self.agree_on_pass(
            loss.detach().item() if is_tensor else math.nan,
            UNKNOWN_BATCH_SIZE if batch_size is None else batch_size,
            failed=not is_tensor and loss is not None,
            check_sizes=batch_size is not None,
            returned_none=loss is None,
            without_factors=without_factors,
        )
        self.without_factors = agreement.without_factors
        if agreement.none_ranks and not agreement.failed_ranks:
            if len(agreement.none_ranks) == self.world_size:
                return None
            raise RuntimeError(
                "DampedNewton refused the step: the closure returned None (a skipped "
                f"batch) on rank(s) {list(agreement.none_ranks)} only; every rank "
                "must skip the same batches. Parameters unchanged on every rank."
            )
        if not is_tensor:
            raise TypeError(
                f"The closure must return the loss tensor, got {type(loss).__name__}."
            )
        if agreement.failed_ranks:
            raise RuntimeError(
                "DampedNewton refused the step: the backward pass raised on rank(s) "
                f"{list(agreement.failed_ranks)}; parameters unchanged on every rank."
            )
        return torch.tensor(agreement.mean_loss, dtype=loss.dtype, device=loss.device)

    def refusal(self, problem: str | None) -> str | None:
        """Why the step is refused on every rank, naming the ranks (all-reduced).

        Args:
            problem: Why this rank refuses (``None``: it does not).

        Returns:
            ``None`` if no rank refuses, else the reason: where the mean loss is not
            finite, the ranks whose local loss is not; else this rank's problem and
            the other refusing ranks, or the refusing ranks.
        """
        flags = torch.zeros(self.world_size, dtype=torch.float64)
        flags[self.rank] = problem is not None
        with self._timed(flags, self._all_reduce_traffic):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            refusing = [rank for rank, flag in enumerate(flags.tolist()) if flag]
        if not refusing:
            return None
        if self._nonfinite_loss_ranks:
            return (
                "the mean loss is not finite: the local loss is not finite on "
                f"rank(s) {list(self._nonfinite_loss_ranks)}"
            )
        others = [rank for rank in refusing if rank != self.rank]
        if problem is None:
            return f"rank(s) {others} refused the step (their errors say why)"
        return f"{problem} on rank {self.rank}" + (
            f" (and rank(s) {others} refused it)" if others else ""
        )

    def mean(self, value: float) -> float:
        """The mean of a number over the ranks (NaN if one is not finite).

        Args:
            value: This rank's number.

        Returns:
            The mean.
        """
        total = torch.tensor([value], dtype=torch.float64)
        with self._timed(total, self._all_reduce_traffic):
            dist.all_reduce(total, group=self.group)
            mean = total.item() / self.world_size
        return mean if math.isfinite(mean) else math.nan

    def broadcast_seed(self, seed: int) -> int:
        """Rank 0's seed, on every rank.

        Args:
            seed: This rank's seed.

        Returns:
            Rank 0's seed.
        """
        value = torch.tensor([seed], dtype=torch.int64)
        with self._timed(value, 0 if self.rank == 0 else 1):
            dist.broadcast(value, group_src=0, group=self.group)
            return int(value.item())

    def sum_over_ranks(self, tensor: Tensor) -> Tensor:
        """The elementwise sum of every rank's ``tensor`` (all-reduced copy).

        Args:
            tensor: This rank's tensor; the same shape and dtype on every rank.

        Returns:
            The sum, a new tensor.
        """
        return self._all_reduced(tensor, dist.ReduceOp.SUM)

    def max_over_ranks(self, tensor: Tensor) -> Tensor:
        """The elementwise maximum of every rank's ``tensor`` (all-reduced copy).

        Args:
            tensor: This rank's tensor; the same shape and dtype on every rank.

        Returns:
            The maximum, a new tensor.
        """
        return self._all_reduced(tensor, dist.ReduceOp.MAX)

    def _all_reduced(self, tensor: Tensor, op: Any) -> Tensor:
        """An all-reduced copy of ``tensor`` (``op``: a ``dist.ReduceOp``)."""
        result = tensor.detach().clone().contiguous()
        with self._timed(result, self._all_reduce_traffic):
            dist.all_reduce(result, op=op, group=self.group)
        return result

    def stack_over_ranks(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, in rank order.

        Args:
            tensor: This rank's tensor; the same shape and dtype on every rank.

        Returns:
            Shape ``[world_size, *tensor.shape]``.
        """
        tensor = tensor.detach().contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._timed(tensor, self.world_size - 1):
            dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)
