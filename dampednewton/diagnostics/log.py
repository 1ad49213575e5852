"""Per-step diagnostic records and their storage as JSON (scalars) plus NPZ (arrays).

A record is a flat ``dict`` from string keys to Python ``int``/``float`` scalars or
NumPy arrays, e.g. ``{"step": 3, "loss": 0.7, "gsnr/mean": 0.02,
"grad_hist/counts": array([...]), ...}``. :meth:`DiagnosticsLog.save` writes
``<stem>.json`` with the scalars of every record (non-finite floats as JSON's
``NaN``/``Infinity`` extensions, which Python reads back) and ``<stem>.npz`` with
the arrays under the keys ``"<record index>/<key>"``.

A log can also hand every record to sinks (:class:`RecordSink`, e.g.
:mod:`~dampednewton.diagnostics.sinks`' TensorBoard and Lightning sinks): give the
monitor ``log=DiagnosticsLog(sinks=[...])``. A record goes to the sinks once it is
complete, when the next record is appended or at :meth:`DiagnosticsLog.flush`: the
monitor may re-assemble the last record, and ``DampedNewton`` adds its
``newton/...`` entries to it after the monitor logged it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

Record = dict[str, int | float | np.ndarray]
_FORMAT = "dampednewton.diagnostics/1"


@runtime_checkable
class RecordSink(Protocol):
    """Where a :class:`DiagnosticsLog` also writes each record it receives."""

    def write(self, record: Record) -> None:
        """Write one record (a dict with an integer ``"step"``)."""


def _check_record(record: Mapping) -> Record:
    checked: Record = {}
    for key, value in record.items():
        if not isinstance(key, str):
            raise TypeError(f"Record keys must be strings, got {key!r}.")
        if isinstance(value, np.ndarray):
            checked[key] = value
        elif isinstance(value, bool | int | np.integer):
            checked[key] = int(value)
        elif isinstance(value, float | np.floating):
            checked[key] = float(value)
        else:
            raise TypeError(
                f"Record value of {key!r} must be an int, a float or a numpy array, "
                f"got {type(value).__name__}."
            )
    if not isinstance(checked.get("step"), int):
        raise ValueError("Every record needs an integer 'step' entry.")
    return checked


class DiagnosticsLog:
    """Ordered list of per-step records with series access and file round trip.

    Attributes:
        sinks: Where every record is also written, once complete.
    """

    def __init__(
        self, records: Iterable[Mapping] = (), *, sinks: Sequence[RecordSink] = ()
    ) -> None:
        """Create a log.

        Args:
            records: Initial records (each needs an integer ``"step"``).
            sinks: Objects with a ``write(record)`` method, called with each
                record (initial ones included) when the next one is appended or
                at :meth:`flush`, and again for a written record that is replaced.

        Raises:
            TypeError: If a sink has no ``write`` method.
        """
        for sink in sinks:
            if not isinstance(sink, RecordSink):
                raise TypeError(
                    f"A sink needs a write(record) method, {sink!r} has none; "
                    "see dampednewton.diagnostics.sinks."
                )
        self.sinks = list(sinks)
        self._records: list[Record] = []
        self._unwritten: int | None = None  # the index of the record not yet written
        for record in records:
            self.append(record)

    def append(self, record: Mapping) -> None:
        """Add a record.

        Args:
            record: Mapping of string keys to ints, floats or numpy arrays, with
                an integer ``"step"``.

        Raises:
            TypeError: If a key or value has an unsupported type.
            ValueError: If ``"step"`` is missing.
        """
        checked = _check_record(record)
        self.flush()
        self._records.append(checked)
        self._unwritten = len(self._records) - 1 if self.sinks else None

    def replace(self, index: int, record: Mapping) -> None:
        """Replace the record at position ``index``.

        Args:
            index: Position of the record to replace.
            record: The new record (checked as in :meth:`append`).
        """
        self._records[index] = _check_record(record)
        if self.sinks and index % len(self._records) != self._unwritten:
            self._write(self._records[index])

    def truncate(self, length: int) -> None:
        """Drop the records from position ``length`` on (unwritten ones stay unwritten).

        Args:
            length: How many records to keep.
        """
        del self._records[length:]
        if self._unwritten is not None and self._unwritten >= length:
            self._unwritten = None

    def flush(self) -> None:
        """Write the last record to the sinks if they do not have it yet.

        Call it after the last step: the log writes a record when the next arrives.
        """
        if self._unwritten is not None:
            index, self._unwritten = self._unwritten, None
            self._write(self._records[index])

    def _write(self, record: Record) -> None:
        for sink in self.sinks:
            sink.write(record)

    def __len__(self) -> int:
        """Return the number of records."""
        return len(self._records)

    def __iter__(self) -> Iterator[Record]:
        """Iterate over the records in insertion order."""
        return iter(self._records)

    def __getitem__(self, index: int) -> Record:
        """Return the record at position ``index``."""
        return self._records[index]

    def keys(self) -> list[str]:
        """Return all keys that occur in some record, sorted."""
        return sorted({key for record in self._records for key in record})

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """Steps and values of a scalar key, over the records that have it.

        Args:
            key: A scalar key such as ``"gsnr/mean"``.

        Returns:
            ``(steps, values)`` as 1-D arrays (int64 and float64).

        Raises:
            KeyError: If no record has ``key``.
            TypeError: If ``key`` holds arrays.
        """
        records = [record for record in self._records if key in record]
        if not records:
            raise KeyError(f"No record has the key {key!r}; available: {self.keys()}.")
        if any(isinstance(record[key], np.ndarray) for record in records):
            raise TypeError(f"Key {key!r} holds arrays; read them from the records.")
        steps = np.array([record["step"] for record in records], dtype=np.int64)
        values = np.array([record[key] for record in records], dtype=np.float64)
        return steps, values

    def save(self, stem: str | Path) -> tuple[Path, Path]:
        """Write ``<stem>.json`` (scalars) and ``<stem>.npz`` (arrays).

        Args:
            stem: Path without suffix; parent folders are created.

        Returns:
            The paths of the JSON and the NPZ file.
        """
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        json_path, npz_path = (
            stem.with_name(stem.name + ".json"),
            stem.with_name(stem.name + ".npz"),
        )
        scalars, arrays = [], {}
        for index, record in enumerate(self._records):
            scalars.append(
                {k: v for k, v in record.items() if not isinstance(v, np.ndarray)}
            )
            for key, value in record.items():
                if isinstance(value, np.ndarray):
                    arrays[f"{index}/{key}"] = value
        json_path.write_text(json.dumps({"format": _FORMAT, "records": scalars}))
        # numpy's stub: mypy checks ** entries against savez's `allow_pickle: bool`.
        np.savez(npz_path, **arrays)  # type: ignore[arg-type]
        return json_path, npz_path

    @classmethod
    def load(cls, stem: str | Path) -> DiagnosticsLog:
        """Read a log written by :meth:`save`.

        Args:
            stem: The same path without suffix that was passed to :meth:`save`.

        Returns:
            The log, with equal records (floats and arrays bitwise equal).

        Raises:
            ValueError: If the JSON file is not a diagnostics log.
        """
        stem = Path(stem)
        content = json.loads(stem.with_name(stem.name + ".json").read_text())
        if not isinstance(content, dict) or content.get("format") != _FORMAT:
            raise ValueError(f"{stem}.json is not a diagnostics log ({_FORMAT}).")
        records = [dict(record) for record in content["records"]]
        with np.load(stem.with_name(stem.name + ".npz"), allow_pickle=False) as data:
            for name in data.files:
                index, key = name.split("/", 1)
                records[int(index)][key] = data[name]
        return cls(records)
