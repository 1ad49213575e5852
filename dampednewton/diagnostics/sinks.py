"""Diagnostics where people look: TensorBoard and Lightning loggers.

A sink receives every record a :class:`~dampednewton.diagnostics.DiagnosticsMonitor`
logs, through the log it appends to, once the record is complete (when the next one
arrives, or at ``log.flush()``)::

    sink = TensorBoardSink("runs/mlp")
    log = DiagnosticsLog(sinks=[sink])
    monitor = DiagnosticsMonitor(specs, log=log)
    ...  # train
    log.flush()  # the last record
    sink.close()

Any object with a ``write(record)`` method is a
:class:`~dampednewton.diagnostics.log.RecordSink`.

How a record is written (:func:`split_record` sorts its entries):

* Scalars (``"loss"``, ``"gsnr/mean/0.weight"``, a histogram's ``below``/``above``/
  ``nan``, ...) as scalars under their key, at the record's ``"step"``.
* One-dimensional histograms (``"<label>/counts[/<name>]"`` with its ``edges``) as
  TensorBoard histograms under the counts key, from the monitor's own edges and
  counts (``add_histogram_raw``, nothing is re-binned). TensorBoard's buckets are
  right edges, so the first edge opens an empty bucket; ``min``/``max`` are the outer
  edges of the non-empty bins, ``sum`` and ``sum_squares`` use the bin centres (the
  monitor keeps counts, not values).
* Two-dimensional histograms (``counts`` with ``x_edges``/``y_edges``) as grey images
  under the counts key (:func:`histogram_image`), plus the scalar
  ``"<label>/out_of_range[/<name>]"``: the pairs outside the ranges, from ``margins``.
  The edges are not written; they stay in the monitor's log.
* Other arrays (``"newton/evals/group0"``, ...) as histograms of their finite
  values, binned by TensorBoard.

The sinks import TensorBoard and Lightning only when they are created; install them
with ``pip install "dampednewton[tensorboard]"`` (and ``[lightning]``). Under
``torch.distributed`` every rank's monitor calls its sinks: give sinks to rank 0's
monitor only (Lightning's loggers write on rank 0 by themselves).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dampednewton.diagnostics.histogram import pairs_outside
from dampednewton.diagnostics.log import Record

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

COUNTS = "/counts"
"""The part of a histogram's counts key between its label and parameter name."""


@dataclass
class SplitRecord:
    """A record's entries sorted by how they are shown.

    Attributes:
        step: The record's step.
        scalars: Scalar entries (without ``"step"``), incl. the 2D histograms'
            ``out_of_range`` counts.
        histograms: Counts key → ``(edges, counts)`` of a 1D histogram.
        histograms_2d: Counts key → ``counts`` (``[x bins, y bins]``) of a 2D one.
        arrays: The other arrays, by key.
    """

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    histograms_2d: dict[str, np.ndarray] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def split_record(record: Mapping[str, Any]) -> SplitRecord:
    """Sort a record's entries into scalars, 1D and 2D histograms and other arrays.

    Args:
        record: A monitor's record.

    Returns:
        The sorted entries; the histograms' edges and margins are not repeated.

    Raises:
        ValueError: If the record has no integer ``"step"``.
    """
    step = record.get("step")
    if not isinstance(step, int):
        raise ValueError(f"A record needs an integer 'step', got {step!r}.")
    split = SplitRecord(step)
    used: set[str] = {"step"}
    for key, value in record.items():
        if not isinstance(value, np.ndarray) or COUNTS not in key:
            continue
        label, _, suffix = key.partition(COUNTS)
        edges = f"{label}/edges{suffix}"
        x_edges, y_edges = f"{label}/x_edges{suffix}", f"{label}/y_edges{suffix}"
        margins = f"{label}/margins{suffix}"
        if value.ndim == 1 and edges in record:
            split.histograms[key] = (np.asarray(record[edges]), value)
            used |= {key, edges}
        elif value.ndim == 2 and x_edges in record and y_edges in record:
            split.histograms_2d[key] = value
            used |= {key, x_edges, y_edges}
            if margins in record:
                outside = pairs_outside(record[margins])
                split.scalars[f"{label}/out_of_range{suffix}"] = float(outside)
                used.add(margins)
    for key, value in record.items():
        if key in used:
            continue
        if isinstance(value, np.ndarray):
            split.arrays[key] = value
        else:
            split.scalars[key] = float(value)
    return split


def histogram_image(counts: np.ndarray) -> np.ndarray:
    """A 2D histogram as a uint8 grey image, parameters up, gradients right.

    Row ``r`` is the ``y`` bin ``Y − 1 − r`` (the largest at the top), column ``c`` the
    ``x`` bin ``c``. Intensities are ``round(255 · log(1 + n) / log(1 + max n))``, so
    sparse bins stay visible next to the peak; an empty histogram is black.

    Args:
        counts: Counts ``[x bins, y bins]`` (as ``numpy.histogram2d``).

    Returns:
        uint8 array ``[y bins, x bins]``.
    """
    upright = np.asarray(counts, dtype=np.float64).T[::-1]
    peak = upright.max(initial=0.0)
    if peak <= 0:
        return np.zeros(upright.shape, dtype=np.uint8)
    return np.rint(255 * np.log1p(upright) / np.log1p(peak)).astype(np.uint8)


@dataclass(frozen=True)
class RawHistogram:
    """A 1D histogram in TensorBoard's terms (``SummaryWriter.add_histogram_raw``).

    Attributes:
        min: Left edge of the first non-empty bin (the first edge if all are empty).
        max: Right edge of the last non-empty bin (the last edge if all are empty).
        num: Number of counted values.
        sum: Sum of the bin centres, weighted by the counts.
        sum_squares: Sum of the squared bin centres, weighted by the counts.
        bucket_limits: The right edges: all ``bins + 1`` edges.
        bucket_counts: ``0`` (below the first edge), then the counts.
    """

    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[int]


def raw_histogram(edges: np.ndarray, counts: np.ndarray) -> RawHistogram:
    """TensorBoard's description of a histogram with these edges and counts.

    Args:
        edges: ``bins + 1`` increasing edges.
        counts: ``bins`` counts.

    Returns:
        The histogram's summary statistics and buckets.

    Raises:
        ValueError: If the shapes do not fit.
    """
    edges = np.asarray(edges, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    if edges.ndim != 1 or counts.shape != (edges.size - 1,):
        raise ValueError(
            f"A histogram needs bins + 1 edges for its bins, got edges of shape "
            f"{edges.shape} and counts of shape {counts.shape}."
        )
    filled = np.flatnonzero(counts)
    low, high = (
        (edges[filled[0]], edges[filled[-1] + 1])
        if filled.size
        else (edges[0], edges[-1])
    )
    centres = (edges[:-1] + edges[1:]) / 2
    return RawHistogram(
        min=float(low),
        max=float(high),
        num=int(counts.sum()),
        sum=float(counts @ centres),
        sum_squares=float(counts @ centres**2),
        bucket_limits=edges.tolist(),
        bucket_counts=[0, *counts.tolist()],
    )


class TensorBoardSink:
    """Writes every record to TensorBoard through a ``SummaryWriter``.

    Example:
        >>> import tempfile
        >>> sink = TensorBoardSink(tempfile.mkdtemp())
        >>> sink.write({"step": 0, "loss": 0.5})
        >>> sink.close()
    """

    def __init__(self, writer: SummaryWriter | str | os.PathLike[str]):
        """Write to a ``SummaryWriter``, or to a new one in a log directory.

        Args:
            writer: A ``torch.utils.tensorboard.SummaryWriter`` (or anything with
                its ``add_scalar``, ``add_histogram``, ``add_histogram_raw`` and
                ``add_image``, e.g. a Lightning ``TensorBoardLogger.experiment``),
                or a log directory for a new writer that this sink owns.

        Raises:
            ImportError: If a directory is given and TensorBoard is not installed.
        """
        self._owned = isinstance(writer, str | os.PathLike)
        self.writer: SummaryWriter = (
            _summary_writer(writer) if isinstance(writer, str | os.PathLike) else writer
        )

    def write(self, record: Record) -> None:
        """Write a record's entries at its step (see the module's docstring).

        Args:
            record: A monitor's record.
        """
        split = split_record(record)
        for key, value in split.scalars.items():
            self.writer.add_scalar(key, value, split.step)
        self.write_arrays(split)

    def write_arrays(self, split: SplitRecord) -> None:
        """Write a record's histograms, images and other arrays, not its scalars.

        Args:
            split: The record, as :func:`split_record` sorts it.
        """
        step = split.step
        for key, (edges, counts) in split.histograms.items():
            raw = raw_histogram(edges, counts)
            self.writer.add_histogram_raw(
                key,
                min=raw.min,
                max=raw.max,
                num=raw.num,
                sum=raw.sum,
                sum_squares=raw.sum_squares,
                bucket_limits=raw.bucket_limits,
                bucket_counts=raw.bucket_counts,
                global_step=step,
            )
        for key, counts in split.histograms_2d.items():
            image = histogram_image(counts)
            self.writer.add_image(key, image, step, dataformats="HW")
        for key, values in split.arrays.items():
            finite = values[np.isfinite(values)]
            if finite.size:
                self.writer.add_histogram(key, finite, step)

    def flush(self) -> None:
        """Write pending events to disk."""
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this sink created it."""
        self.writer.flush()
        if self._owned:
            self.writer.close()


class MetricsLogger(Protocol):
    """A Lightning logger's scalar interface."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> Any:
        """Log scalars at a step."""


class LightningLoggerSink:
    """Writes every record through a Lightning logger.

    Scalars go to ``logger.log_metrics`` (any Lightning logger: TensorBoard, CSV,
    W&B, ...). With a ``TensorBoardLogger`` the histograms and images go to its
    ``experiment`` (the ``SummaryWriter``) as :class:`TensorBoardSink` writes them;
    other loggers have no histograms: pass ``arrays=False`` to log their scalars only.
    """

    def __init__(self, logger: MetricsLogger, arrays: bool = True):
        """Log through a Lightning logger.

        Args:
            logger: A ``lightning`` logger, e.g. ``trainer.logger``.
            arrays: Write histograms and other arrays too (needs a
                ``TensorBoardLogger``).

        Raises:
            ImportError: If ``arrays`` is set and Lightning is not installed.
            ValueError: If there is no logger, or ``arrays`` is set and it is not
                a ``TensorBoardLogger``.
        """
        if logger is None:
            raise ValueError(
                "LightningLoggerSink got no logger (a Trainer(logger=False) has "
                "none): give the Trainer a logger, or write the records with "
                "TensorBoardSink(log_dir) instead."
            )
        if arrays and not _is_tensorboard_logger(logger):
            raise ValueError(
                f"{type(logger).__name__} cannot show histograms; use a "
                "lightning TensorBoardLogger, or LightningLoggerSink(logger, "
                "arrays=False) to log the scalars only."
            )
        self.logger: Any = logger  # a TensorBoardLogger also has `experiment`
        self.arrays = arrays

    def write(self, record: Record) -> None:
        """Log a record's scalars, and with ``arrays`` its arrays.

        Args:
            record: A monitor's record.
        """
        split = split_record(record)
        if split.scalars:
            self.logger.log_metrics(split.scalars, step=split.step)
        if self.arrays:
            # On ranks other than 0 the experiment is Lightning's no-op
            # DummyExperiment, as log_metrics is a no-op there.
            TensorBoardSink(self.logger.experiment).write_arrays(split)


def _summary_writer(log_dir: str | os.PathLike[str]) -> SummaryWriter:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "TensorBoardSink needs TensorBoard: pip install "
            '"dampednewton[tensorboard]" (or pip install tensorboard).'
        ) from error
    return SummaryWriter(log_dir=os.fspath(log_dir))


def _is_tensorboard_logger(logger: object) -> bool:
    """Whether ``logger`` is a TensorBoard logger (``lightning`` or standalone)."""
    classes = []
    for module in ("lightning.fabric.loggers", "lightning_fabric.loggers"):
        try:
            classes.append(importlib.import_module(module).TensorBoardLogger)
        except ImportError:
            continue
    if not classes:
        raise ImportError(
            "LightningLoggerSink needs Lightning: pip install "
            '"dampednewton[lightning]" (or pip install lightning).'
        )
    return isinstance(logger, tuple(classes))
