"""The reducer of both histogram specs: per-parameter and network histograms.

A spec (:mod:`~dampednewton.diagnostics.specs.histograms`) says how many axes it
bins, their range policies and the histogram function; :class:`HistogramReducer`
bins each parameter's individual gradients (and values) in its own ranges and in the
network's, and under data parallelism agrees on the ranges with the other ranks and
sums the counts (:mod:`~dampednewton.diagnostics.ranks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from backpack.extensions import BatchGrad
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor

from dampednewton.backpack.savefields import GRAD_BATCH
from dampednewton.diagnostics.bin_adaptation import range_hull
from dampednewton.diagnostics.histogram import Histogram1d, Histogram2d, OutOfRange
from dampednewton.diagnostics.ranks import (
    SINGLE_PROCESS,
    Ranks,
    agreed_ranges,
    check_agreeable,
    summed_over_ranks,
)
from dampednewton.diagnostics.reducer import Entries, NamedParams, pieces_of, quantity
from dampednewton.diagnostics.specs.checks import check_range

if TYPE_CHECKING:
    from dampednewton.diagnostics.specs.histograms import (
        GradientHistogram,
        GradientParameterHistogram,
    )

_OUT_OF_RANGE: dict[str, OutOfRange] = {"dampednewton": "count", "cockpit": "clamp"}
"""How each histogram semantics bins out-of-range values."""

_FIELDS = {
    Histogram1d: (
        ("counts", "edges", "below", "above", "nan"),
        ("counts", "below", "above", "nan"),
    ),
    Histogram2d: (
        ("counts", "x_edges", "y_edges", "margins", "nan"),
        ("counts", "margins", "nan"),
    ),
}
"""Per histogram type: the record fields, and those summed into the network's."""

Ranges = tuple[tuple[float, float], ...]
"""One ``(low, high)`` range per axis."""


class HistogramReducer:
    """Per-parameter and network histograms of a 1D or 2D histogram spec.

    Each parameter is binned in its own range (from the spec's range policies) and,
    for the network histogram, in the network range: with ``"dampednewton"``
    semantics the hull of the per-parameter ranges of the previous tracked step,
    so the layers are binned while they stream by; with ``"cockpit"`` semantics the
    hull of this step's ranges, so the data are kept and binned in :meth:`assemble`.
    Under data parallelism the ranks first agree on the ranges of the global batch,
    so every layer's data are kept until :meth:`assemble` (memory ``N·D``), and the
    counts are summed over the ranks
    (:mod:`~dampednewton.diagnostics.ranks`).

    Attributes:
        spec: The histogram diagnostic.
        network_ranges: The network histogram's ranges, one per axis.
    """

    def __init__(
        self,
        spec: GradientHistogram | GradientParameterHistogram,
        *,
        pairs_with_values: bool,
    ) -> None:
        """Create the reducer.

        Args:
            spec: The histogram diagnostic.
            pairs_with_values: Pair each gradient element with its parameter's value
                (two axes) instead of binning gradient elements alone.
        """
        self.spec = spec
        self.network_ranges: Ranges = spec.initial_ranges
        self._pairs_with_values = pairs_with_values
        self._ranks: Ranks = SINGLE_PROCESS
        self._binning_ranges: Ranges = self.network_ranges
        self._pieces: dict[int, tuple] = {}

    def resume_from(self, network_ranges: Ranges) -> None:
        """Continue with saved network ranges (of a checkpointed run).

        Raises:
            ValueError: Unless they are one finite ``(low, high)`` per axis.
        """
        axes = len(self.spec.initial_ranges)
        if len(network_ranges) != axes:
            raise ValueError(
                f"The histogram {self.spec.label!r} needs one network range per "
                f"axis ({axes}), the saved ones are {network_ranges}."
            )
        self.network_ranges = tuple(
            check_range(f"the saved network range of {self.spec.label!r}", axis)
            for axis in network_ranges
        )

    def extensions(self) -> list[BackpropExtension]:
        """Return ``[BatchGrad()]``."""
        return [BatchGrad()]

    def begin(self, ranks: Ranks) -> None:
        """Forget the previous step; this one's global batch is split over ``ranks``.

        Args:
            ranks: The ranks of the step's global batch.

        Raises:
            ValueError: For a :class:`PercentileRange` under data parallelism.
        """
        if ranks.world_size > 1:
            check_agreeable(self.spec.range_policies)
        self._ranks = ranks
        self._binning_ranges = self.network_ranges
        self._pieces = {}

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Bin ``N·grad_batch`` (and the parameter) with own and network ranges.

        Under data parallelism, keep them for :meth:`assemble` instead.

        Args:
            param: Parameter whose module's backward just ran.
            batch_size: Number of samples ``N`` of this rank.
        """
        grad_batch = quantity(param, GRAD_BATCH)
        if grad_batch is None:
            return
        axes: tuple[Tensor, ...] = (grad_batch * batch_size,)
        if self._pairs_with_values:
            # Parameter values as they are now, before any update.
            axes = (*axes, param.detach().clone())
        if self._ranks.world_size > 1:
            self._pieces[id(param)] = axes
            return
        spec = self.spec
        own_ranges = tuple(
            policy.compute(values)
            for policy, values in zip(spec.range_policies, axes, strict=True)
        )
        self._pieces[id(param)] = self._binned(axes, own_ranges)

    def _binned(self, axes: tuple[Tensor, ...], own_ranges: Ranges) -> tuple:
        """A parameter's ranges, own histogram and part of the network histogram.

        Args:
            axes: Its values along each axis.
            own_ranges: Its own ranges.

        Returns:
            ``(own_ranges, own histogram, network part)``; the network part is the
            values themselves for ``"cockpit"`` semantics (binned in
            :meth:`assemble`).
        """
        spec = self.spec
        own = spec.binned(axes, own_ranges, _OUT_OF_RANGE[spec.semantics])
        if spec.semantics == "cockpit":
            network = axes
        elif own_ranges != self._binning_ranges:
            network = spec.binned(axes, self._binning_ranges, "count")
        else:
            network = own
        return (own_ranges, own, network)

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Per-parameter and network histograms; update the next network ranges.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples (unused).

        Returns:
            Record entries (tensors).
        """
        pieces = [
            pieces_of(self._pieces, name, param, GRAD_BATCH)
            for name, param in named_params
        ]
        if self._ranks.world_size > 1:
            ranges = agreed_ranges(self.spec.range_policies, pieces, self._ranks)
            pieces = [
                self._binned(axes, own_ranges)
                for axes, own_ranges in zip(pieces, ranges, strict=True)
            ]
        own_ranges, own, network = (
            list(column) for column in zip(*pieces, strict=True)
        )
        self.network_ranges = tuple(
            range_hull(axis) for axis in zip(*own_ranges, strict=True)
        )
        if self.spec.semantics == "cockpit":
            network = [
                self.spec.binned(axes, self.network_ranges, "clamp") for axes in network
            ]
        *own, total = _summed_over_ranks([*own, _summed(network)], self._ranks)
        label = self.spec.label
        entries: Entries = {}
        for (name, _), histogram in zip(named_params, own, strict=True):
            entries.update(_entries(label, histogram, f"/{name}"))
        entries.update(_entries(label, total, ""))
        return entries


def _summed_over_ranks(histograms: list, ranks: Ranks) -> list:
    """The histograms with their counts summed over the ranks, in one collective."""
    names = [_FIELDS[type(h)][1] for h in histograms]
    counts = [
        getattr(h, name)
        for h, fields in zip(histograms, names, strict=True)
        for name in fields
    ]
    totals = iter(summed_over_ranks(counts, ranks))
    return [
        h._replace(**{name: next(totals) for name in fields})
        for h, fields in zip(histograms, names, strict=True)
    ]


def _summed(histograms: list):
    """The network histogram: per-parameter ones in the same range, added up."""
    _, summed_fields = _FIELDS[type(histograms[0])]
    return histograms[0]._replace(
        **{
            name: torch.stack([getattr(h, name) for h in histograms]).sum(0)
            for name in summed_fields
        }
    )


def _entries(label: str, histogram, suffix: str) -> Entries:
    fields, _ = _FIELDS[type(histogram)]
    return {f"{label}/{name}{suffix}": getattr(histogram, name) for name in fields}
