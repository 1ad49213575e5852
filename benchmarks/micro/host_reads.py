"""Counting the host reads of device values (the syncs a GPU would pay), on any device.

A read of a tensor's value on the host (``item``, ``bool(t)``, ``tolist``) or an
operation whose output shape depends on the values (``nonzero``, boolean masks) waits
for the device on a GPU. :class:`HostReads` counts them on the CPU too, each with the
innermost frame of the package (or of BackPACK) that caused it.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter

import backpack
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import dampednewton

# Operators that read values on the host or size their output by them.
READING_OPERATORS = (
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",
)
# Indexing operators that read a boolean mask's values to size their output.
MASKING_OPERATORS = ("index", "index_put", "index_put_", "_index_put_impl_")
# Python-level reads that do not reach the dispatcher.
READING_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy}


_PACKAGES = {
    "dampednewton/": os.path.dirname(dampednewton.__file__) + os.sep,
    "backpack/": os.path.dirname(backpack.__file__) + os.sep,
}


def _origin() -> str:
    """The innermost frame in dampednewton or backpack, as ``package/path:line``."""
    for frame in reversed(traceback.extract_stack()):
        for package, root in _PACKAGES.items():
            if frame.filename.startswith(root):
                return f"{package}{frame.filename[len(root) :]}:{frame.lineno}"
    return "elsewhere"


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in READING_OPERATORS or (
            name in MASKING_OPERATORS and _has_boolean_index(args)
        ):
            self.counts[_origin()] += 1
        return func(*args, **(kwargs or {}))


def _has_boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool
        for i in (indices if isinstance(indices, list | tuple) else (indices,))
    )


class _Function(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READING_METHODS:
            self.counts[_origin()] += 1
        return func(*args, **(kwargs or {}))


class HostReads:
    """Context manager counting host reads by origin (``counts``: a Counter)."""

    def __init__(self) -> None:
        """Start at zero."""
        self.counts: Counter = Counter()
        self._modes = (_Function(self.counts), _Dispatch(self.counts))

    def __enter__(self) -> HostReads:
        """Start counting."""
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        """Stop counting."""
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def of(self, package: str) -> int:
        """Reads caused by a package (``'dampednewton/'`` or ``'backpack/'``)."""
        return sum(n for origin, n in self.counts.items() if origin.startswith(package))
