"""Bounded CPU thread counts for the step's small dense linear algebra.

torch runs CPU operations on one intra-op thread per core. For the small symmetric
eigenproblems of a step (the Gram matrix ``VᵀV`` is ``N×N`` or ``N·C×N·C``) threads
hardly pay off, and on a machine whose cores are busy with other work, OpenMP's
waiting threads made one ``eigh`` of a 128×128 Gram matrix take seconds instead of a
millisecond. :func:`small_matrix_threads` runs such solves on
``SMALL_MATRIX_THREADS`` threads (default 1; ``None`` keeps torch's count) and
restores torch's count afterwards (``benchmarks/micro/cpu_threads.py`` measures the
effect). Setting ``dampednewton.threads.SMALL_MATRIX_THREADS`` changes the bound of
every later solve.

The machinery lives in :mod:`dampednewton.math.threads`, below the linear algebra
that uses it; this module is its public face and forwards the setting there.
"""

from __future__ import annotations

import sys
from types import ModuleType

from dampednewton.math import threads as _bound
from dampednewton.math.threads import (
    SMALL_MATRIX_SIZE,
    limited_threads,
    small_matrix_threads,
)

__all__ = [
    "SMALL_MATRIX_SIZE",
    "SMALL_MATRIX_THREADS",
    "limited_threads",
    "small_matrix_threads",
]

SMALL_MATRIX_THREADS: int | None
"""Threads for small dense solves on CPU; ``None`` keeps torch's count for them."""


class _ForwardedSetting(ModuleType):
    """This module, with ``SMALL_MATRIX_THREADS`` read from and written to the bound."""

    @property
    def SMALL_MATRIX_THREADS(self) -> int | None:
        """The bound of :mod:`dampednewton.math.threads`."""
        return _bound.SMALL_MATRIX_THREADS

    @SMALL_MATRIX_THREADS.setter
    def SMALL_MATRIX_THREADS(self, value: int | None) -> None:
        _bound.SMALL_MATRIX_THREADS = value


sys.modules[__name__].__class__ = _ForwardedSetting
