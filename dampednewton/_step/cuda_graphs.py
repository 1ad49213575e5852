"""A pure function of fixed tensors, replayed as a CUDA graph.

A packed step (:mod:`._step.kronecker_packed`) computes its directions from tensors
that keep their memory for the run: the pack's gradient buffer (the step copies
``.grad`` into it first), its padded eigenpairs (a refresh copies its own into them)
and coefficients. Its kernels can then be recorded once and replayed with one launch
(:class:`ReplayedMath`), where a small model's step lasts as long as its launches.
A replay overwrites the outputs of the one before: they are read within the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

Outputs = TypeVar("Outputs")

RECORDING_FAILED = (
    "DampedNewton could not record the packed step's math as a CUDA graph ({error}); "
    "this pack's steps run it as they are, the same steps without the single launch "
    "(a pack rebuilt for new layer shapes tries again). KroneckerBasis(graphed=False) "
    "skips the attempt."
)

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
"""The side stream of each CUDA device's recordings (see :func:`capture_stream`)."""

EAGER_CALLS = 1
"""Calls of a function run as they are before it is recorded: a pack used for one
step only (rebuilt at the next refresh, for layers whose kept ranks changed) is never
recorded."""


class ReplayedMath(Generic[Outputs]):
    """``math()`` eager for :data:`EAGER_CALLS` calls, then a CUDA graph's replays.

    ``math`` must read only tensors whose memory stays, launch no host
    synchronization, and return the same structure of tensors each time. The
    recorded outputs are returned by every replay, their values overwritten. Where
    the recording fails (a CUDA error), a warning says so and every call computes.
    """

    def __init__(self, math: Callable[[], Outputs], device: torch.device) -> None:
        """Keep the function (nothing is recorded yet).

        Args:
            math: The function.
            device: Its CUDA device.
        """
        self._math = math
        self._device = device
        self._calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Outputs | None = None
        self._failed = False

    @property
    def replaying(self) -> bool:
        """Whether the function was recorded (its calls replay the graph)."""
        return self._graph is not None

    def __call__(self) -> Outputs:
        """``math()``: computed, or the graph replayed into the recorded outputs."""
        if self._graph is None:
            self._calls += 1
            if self._calls <= EAGER_CALLS or self._failed:
                return self._math()
            try:
                self._graph, self._outputs = record_graph(self._math, self._device)
            except RuntimeError as error:  # nothing was run or changed: compute
                self._failed = True
                warnings.warn(
                    RECORDING_FAILED.format(error=error), RuntimeWarning, stacklevel=2
                )
                return self._math()
        self._graph.replay()
        assert self._outputs is not None
        return self._outputs


def record_graph(
    math: Callable[[], Outputs], device: torch.device
) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """``math``'s kernels as a CUDA graph (not yet run) and its output tensors.

    On a side stream that waits for the current one: one call first, as PyTorch's
    capture asks (libraries set up their workspaces outside the graph), then the
    recording. ``torch.cuda.graph`` would also synchronize the device and empty the
    allocator's cache on every recording; the recording alone needs neither.

    Args:
        math: A function of fixed tensors (see :class:`ReplayedMath`).
        device: Its CUDA device.

    Returns:
        The graph and the tensors its replays write.
    """
    with torch.cuda.device(device), torch.no_grad():
        current = torch.cuda.current_stream()
        side = capture_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            math()
            graph = torch.cuda.CUDAGraph()
            # Another thread's CUDA calls (a data loader's pinning) do not break it.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = math()
            finally:
                graph.capture_end()
        current.wait_stream(side)
    return graph, outputs


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream that records on ``device`` (created on first use).

    torch keeps a cuBLAS workspace for each stream that runs products, for the rest
    of the process (32 MiB on Hopper GPUs by default): a new stream per recording
    (when packs were recorded at every refresh) cycled through torch's 32 pooled
    streams and would hold up to
    about 1 GiB of workspaces (with a new stream per recording fmnist_2c2d's peak
    was 1,785 MiB on an H100 against the packed eager step's 710; with this one
    stream 793 MiB, docs/performance.md). ``torch.cuda.graph`` likewise keeps one
    default capture stream.

    Args:
        device: A CUDA device.

    Returns:
        Its capture stream.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return stream
