"""The backward passes of one closure, and the buffers the engine keeps of them.

A closure that accumulates gradients runs one backward pass per micro-batch; under
data parallelism every rank's pass is gathered after the closure. In both cases the
engine keeps each layer's BackPACK buffers until the closure returned:
:class:`ClosurePasses` holds them per micro-batch and hands back each layer's
buffers of the whole (local) batch, the micro-batches concatenated
(:mod:`dampednewton.backpack.micro_batches`). Only the buffers are kept: each
micro-batch's graph is freed by its backward pass as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from dampednewton.backpack.global_batch import Stored
from dampednewton.backpack.micro_batches import (
    MicroBatch,
    concatenated_layer,
    square_root_scales,
)


@dataclass(frozen=True)
class KeptBuffers:
    """A parameter's BackPACK buffers, kept until the closure returned.

    Attributes:
        index: The parameter's group.
        param: The parameter.
        stored: What the extensions stored on it.
    """

    index: int
    param: Tensor
    stored: Stored


class ClosurePasses:
    """The micro-batches of one closure: sizes, loss weights and kept buffers."""

    def __init__(self) -> None:
        """Start without a backward pass."""
        self._finished: list[MicroBatch] = []
        self._current: MicroBatch | None = None
        self._groups: dict[tuple[int, ...], list[tuple[int, Tensor]]] = {}

    @property
    def count(self) -> int:
        """Micro-batches (backward passes through the loss) so far."""
        return len(self._finished) + (self._current is not None)

    @property
    def batch_size(self) -> int | None:
        """Samples of every micro-batch together (``None``: no pass yet)."""
        if self._current is None:
            return None
        return sum(m.batch_size for m in (*self._finished, self._current))

    def start(self, batch_size: int, weight: Tensor | None) -> None:
        """A backward pass reached the loss: a new micro-batch starts.

        Args:
            batch_size: Its number of samples.
            weight: The gradient that reached its loss (``None``: 1).
        """
        if self._current is not None:
            self._finished.append(self._current)
        self._current = MicroBatch(batch_size, weight, {})

    def keep(self, layer: Sequence[KeptBuffers], batch_size: int) -> None:
        """Keep a layer's buffers of the current micro-batch.

        Args:
            layer: The buffers of the layer's parameters.
            batch_size: The micro-batch's size, if no loss started it.
        """
        if self._current is None:
            self.start(batch_size, None)
        assert self._current is not None
        key = tuple(id(entry.param) for entry in layer)
        self._groups.setdefault(key, [(entry.index, entry.param) for entry in layer])
        self._current.layers[key] = [entry.stored for entry in layer]

    def clear(self) -> None:
        """Forget every pass and buffer."""
        self._finished, self._current, self._groups = [], None, {}

    def take(self) -> list[tuple[int, list[KeptBuffers]]]:
        """Each layer's buffers of the whole batch, then forget every pass.

        Returns:
            Per layer (in the first micro-batch's backward order), the batch size
            and its parameters' buffers, the micro-batches concatenated.

        Raises:
            RuntimeError: If the micro-batches did not reach the same layers.
        """
        micro_batches = [*self._finished]
        if self._current is not None:
            micro_batches.append(self._current)
        groups = self._groups
        self.clear()
        if not micro_batches:
            return []
        first = micro_batches[0]
        for number, micro_batch in enumerate(micro_batches[1:], start=2):
            if micro_batch.layers.keys() != first.layers.keys():
                raise RuntimeError(
                    f"Micro-batch {number} of the closure reached other parameters "
                    "than micro-batch 1, so the batch's curvature cannot be "
                    "assembled. Every micro-batch must run through the same layers."
                )
        if len(micro_batches) == 1:
            return [
                (first.batch_size, _entries(groups[key], stored))
                for key, stored in first.layers.items()
            ]
        scales = square_root_scales(micro_batches)
        total = sum(m.batch_size for m in micro_batches)
        return [
            (
                total,
                _entries(
                    groups[key],
                    concatenated_layer([m.layers[key] for m in micro_batches], scales),
                ),
            )
            for key in first.layers
        ]


def _entries(
    params: Sequence[tuple[int, Tensor]], stored: Sequence[Stored]
) -> list[KeptBuffers]:
    return [
        KeptBuffers(index, param, entry)
        for (index, param), entry in zip(params, stored, strict=True)
    ]
