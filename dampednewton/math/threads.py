"""Bounded CPU thread counts for the step's small dense linear algebra.

torch runs CPU operations on one intra-op thread per core. For the small symmetric
eigenproblems of a step (the Gram matrix ``VᵀV`` is ``N×N`` or ``N·C×N·C``) threads
hardly pay off, and on a machine whose cores are busy with other work, OpenMP's
waiting threads made one ``eigh`` of a 128×128 Gram matrix take seconds instead of a
millisecond. :func:`small_matrix_threads` runs such solves on
:data:`SMALL_MATRIX_THREADS` threads and restores torch's count afterwards
(``benchmarks/threads.py`` measures the effect). The thread count is process-wide:
other Python threads running torch operations at the same time see it too.

The public face is :mod:`dampednewton.threads`; setting its ``SMALL_MATRIX_THREADS``
sets the one here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import Tensor

SMALL_MATRIX_THREADS: int | None = 1
"""Threads for small dense solves on CPU; ``None`` keeps torch's count for them."""

SMALL_MATRIX_SIZE = 512
"""Matrices with at most this many rows count as small."""


@contextmanager
def limited_threads(limit: int) -> Iterator[None]:
    """Run the block on at most ``limit`` intra-op threads, then restore the count.

    The previous count is restored also when the block raises. Fewer threads than
    ``limit`` (e.g. ``torch.set_num_threads(1)`` by the user) are kept.

    Args:
        limit: Maximum number of threads (>= 1).

    Yields:
        Nothing; run the operations inside.

    Raises:
        ValueError: If ``limit < 1``.
    """
    if limit < 1:
        raise ValueError(f"The thread limit must be >= 1, got {limit}.")
    previous = torch.get_num_threads()
    if previous <= limit:
        yield
        return
    torch.set_num_threads(limit)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def small_matrix_threads(matrix: Tensor) -> AbstractContextManager[None]:
    """The thread bound for a dense solve on ``matrix``, if it is small and on CPU.

    Args:
        matrix: The square matrix about to be decomposed.

    Returns:
        :func:`limited_threads` with :data:`SMALL_MATRIX_THREADS` for CPU matrices of
        at most :data:`SMALL_MATRIX_SIZE` rows, else a context that changes nothing.
    """
    if (
        SMALL_MATRIX_THREADS is None
        or matrix.device.type != "cpu"
        or matrix.shape[0] > SMALL_MATRIX_SIZE
    ):
        return nullcontext()
    return limited_threads(SMALL_MATRIX_THREADS)
