"""The contract between a diagnostic spec, its reducer and the monitor.

A spec (a frozen dataclass in :mod:`~dampednewton.diagnostics.specs`) says what to
compute and when; its :meth:`~DiagnosticSpec.make_reducer` creates the
:class:`Reducer` that does the per-step plumbing. During backward,
:meth:`Reducer.reduce` turns one parameter's BackPACK quantities into small pieces
(counts, sums, references to parameter-sized tensors) so the per-sample tensors can be
freed layer by layer; it never deletes BackPACK's attributes. After backward,
:meth:`Reducer.assemble` builds the record entries (tensors, still on the device)
from those pieces and ``p.grad``, exchanging what the global batch needs under data
parallelism (:mod:`~dampednewton.diagnostics.ranks`). Reducers hold the state of one
step at a time (:meth:`Reducer.begin`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor, nn

from dampednewton.backpack.savefields import (
    DIAGONALS,
    GRAD_BATCH,
    SUM_GRAD_SQUARED,
)
from dampednewton.diagnostics.ranks import Ranks
from dampednewton.diagnostics.schedules import Schedule

NamedParams = Sequence[tuple[str, Tensor]]
"""``(name, parameter)`` pairs with gradients."""

Entries = dict[str, Tensor]
"""Record entries of one diagnostic, by key."""


class MissingQuantityError(RuntimeError):
    """BackPACK did not compute a quantity that a diagnostic needs."""


class Reducer(Protocol):
    """Plumbing of one diagnostic for one step at a time."""

    @property
    def spec(self) -> DiagnosticSpec:
        """The diagnostic it computes."""
        ...

    def extensions(self) -> list[BackpropExtension]:
        """BackPACK extensions this diagnostic needs."""
        ...

    def begin(self, ranks: Ranks) -> None:
        """Forget the previous step; this one's global batch is split over ``ranks``."""
        ...

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Reduce the BackPACK quantities of ``param`` (inside the backward hook)."""
        ...

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Record entries for the parameters ``named_params`` (after backward).

        ``batch_size`` is the global batch's; ``.grad`` is its mean gradient.
        """
        ...


class DiagnosticSpec(Protocol):
    """What every diagnostic spec provides."""

    @property
    def schedule(self) -> Schedule:
        """When to compute."""
        ...

    @property
    def label(self) -> str:
        """Prefix of the record keys."""
        ...

    def make_reducer(self) -> Reducer:
        """Create the reducer that computes this diagnostic."""
        ...


def quantity(param: Tensor, savefield: str) -> Tensor | None:
    """The BackPACK quantity ``savefield`` of ``param``, detached, if present.

    Args:
        param: A parameter whose module's backward just ran.
        savefield: The attribute BackPACK writes.

    Returns:
        The quantity, or ``None``.
    """
    value = getattr(param, savefield, None)
    return None if value is None else value.detach()


def detached_gradient_of(param: Tensor) -> Tensor:
    """The detached ``.grad`` of a parameter from :data:`NamedParams`.

    Args:
        param: A parameter the monitor passed to :meth:`Reducer.assemble`.

    Returns:
        Its gradient, detached.

    Raises:
        RuntimeError: If it has none (the monitor passes only those that have one).
    """
    if param.grad is None:
        raise RuntimeError("Reducers assemble only parameters with a gradient.")
    return param.grad.detach()


def pieces_of(pieces: Mapping[int, object], name: str, param: Tensor, savefield: str):
    """A parameter's reduced pieces, or an error naming what BackPACK did not compute.

    Args:
        pieces: Pieces by parameter ``id``.
        name: The parameter's name, for the message.
        param: The parameter.
        savefield: The quantity the pieces come from, for the message.

    Returns:
        The parameter's pieces.

    Raises:
        MissingQuantityError: If the parameter has none.
    """
    try:
        return pieces[id(param)]
    except KeyError:
        raise MissingQuantityError(
            f"BackPACK computed no '{savefield}' for parameter '{name}' although it "
            "has a gradient. Is its module extended with backpack.extend and "
            "supported by BackPACK's extensions?"
        ) from None


def reducer_of(spec: DiagnosticSpec) -> Reducer:
    """The reducer of a diagnostic spec, or what to pass instead.

    Args:
        spec: What was given as a diagnostic.

    Returns:
        ``spec.make_reducer()``.

    Raises:
        TypeError: For anything without ``make_reducer`` (e.g. a name).
    """
    make_reducer = getattr(spec, "make_reducer", None)
    if not callable(make_reducer):
        raise TypeError(
            f"Unknown diagnostic {spec!r}; use one of GSNR, NoiseScale, "
            "GradientHistogram, GradientParameterHistogram, CurvatureTrace (or a "
            "spec with make_reducer())."
        )
    return make_reducer()


def quantities_batch_size(module: nn.Module, param: Tensor) -> int | None:
    """Number of samples of the module's last input, if BackPACK processed it."""
    if not any(
        hasattr(param, savefield)
        for savefield in (GRAD_BATCH, SUM_GRAD_SQUARED, *DIAGONALS)
    ):
        return None
    # The module input gives the full batch even if another party's BatchGrad
    # subsampled grad_batch (which still stores ∇ℓ_n/N with the full N).
    module_input = getattr(module, "input0", None)
    if module_input is not None:
        return module_input.shape[0]
    grad_batch = getattr(param, GRAD_BATCH, None)
    return None if grad_batch is None else grad_batch.shape[0]


def to_host(value: Tensor) -> int | float | np.ndarray:
    """A record entry on the host: a Python number or a NumPy array."""
    value = value.detach().cpu()
    if value.dim() > 0:
        return value.numpy()
    return value.item()
