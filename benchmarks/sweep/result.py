"""The record of one benchmark job and its ``result.json`` (read and written here only).

A job never raises (:mod:`benchmarks.sweep.job`): it ends with one of the statuses

* ``"ok"``: trained; every field is set.
* ``"diverged"``: trained until the divergence rule fired (``divergence`` says why;
  the final metrics are ``None``).
* ``"failed"``: raised; ``error`` and ``traceback`` say what, the training fields are
  their defaults.
* ``"skipped"``: not run (``grid_point`` beyond its optimizer's grid, or a damping
  rule given to an optimizer without damping).

Non-finite floats are written as ``null`` (strict JSON). The file is written
atomically (:mod:`benchmarks.sweep.atomic`): it is complete or absent, so that a rerun
of the sweep can trust it (:mod:`benchmarks.sweep.resume`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from benchmarks.measure import MemoryReading
from benchmarks.sweep.atomic import write_atomically
from benchmarks.sweep.training import Curves

RESULT_FILE = "result.json"

Status = Literal["ok", "diverged", "failed", "skipped"]

T = TypeVar("T")
STATUSES: tuple[Status, ...] = ("ok", "diverged", "failed", "skipped")


@dataclass
class FinalMetrics:
    """The metrics of the last evaluation (``None`` after a divergence).

    Attributes:
        train_loss: Loss on the training-evaluation samples.
        test_loss: Loss on the test set.
        test_metric: The problem's test metric.
    """

    train_loss: float | None = None
    test_loss: float | None = None
    test_metric: float | None = None


def recorded(value: T | None, name: str) -> T:
    """A measurement that every successful run (``status == "ok"``) records.

    Args:
        value: The run's field.
        name: Its name, for the error.

    Returns:
        ``value``.

    Raises:
        ValueError: If the run has no such measurement.
    """
    if value is None:
        raise ValueError(f"A successful run records {name}; this one has none.")
    return value


@dataclass
class StepTime:
    """Per-step wall-clock time.

    Attributes:
        median: Median seconds per step after warm-up (``None``: too few steps).
        warmup_steps: First steps left out of the median.
    """

    median: float | None = None
    warmup_steps: int = 0


@dataclass
class RunResult:
    """One job's record: what ran, how it ended, and what it measured.

    Attributes:
        problem: Problem name.
        optimizer: Optimizer name (``optimizer_name`` of the config).
        seed: The job's seed.
        status: How the job ended (see the module docstring).
        error: ``"<exception type>: <message>"`` of a failed job.
        traceback: Its traceback.
        skip_reason: Why a skipped job did not run.
        grid_point: The sweep grid's settings applied to the optimizer (``{}``
            without a grid).
        hyperparameters: The optimizer's settings, flattened with dotted keys
            (``None`` when the job failed before they were known).
        metric: ``"accuracy"`` or ``"loss"``.
        maximize: Whether the metric is to be maximized.
        targets: The problem's metric targets, easier first.
        curves: The evaluations along training.
        final: The last evaluation's metrics.
        best_test_metric: The best test metric over the evaluations.
        steps_to_target: Per target, the first evaluated step that reached it.
        time_to_target: Training seconds at those steps.
        steps_taken: Optimizer steps taken.
        resumed_from_step: The checkpoint step a rerun continued from (``None``: the
            job trained from step 0; see :mod:`benchmarks.sweep.checkpointing`).
        train_time: Training seconds (evaluations excluded).
        step_time: Median time per step.
        memory: Peak memory (:mod:`benchmarks.measure`).
        divergence: Why the run counts as diverged (``None``: it did not).
        at_chance_level: It counts as diverged for ending at chance level (a
            budget too short to learn, or a setting that does not learn).
        device: The device, e.g. ``"cpu"``.
        device_name: The CUDA device's or the CPU's name.
        num_threads: ``torch.get_num_threads()`` during the job.
        torch_version: ``torch.__version__``.
        num_parameters: Trainable parameters of the model.
        world_size: Processes of a data-parallel job (``torchrun``; 1: one process).
        communication_per_step: Mean seconds per step that rank 0's optimizer spent
            in its ``torch.distributed`` collectives (``DampedNewton``'s
            ``communication_seconds``; ``None`` for one process or an optimizer
            without that count).
        config: The job's resolved config.
        overrides: The Hydra job's command-line overrides (``[]`` for a job the
            grid extension added); a rerun of the sweep checks them and ``config``
            before it keeps the result (:mod:`benchmarks.sweep.resume`).
        job_dir: The directory of ``result.json`` (set when read or written, not
            stored in the file).
        resumed: Whether this job was not run because an earlier run of the same
            sweep left its complete result (not stored in the file).
    """

    problem: str
    optimizer: str
    seed: int
    status: Status = "failed"
    error: str | None = None
    traceback: str | None = None
    skip_reason: str | None = None
    grid_point: dict[str, Any] = field(default_factory=dict)
    hyperparameters: dict[str, Any] | None = None
    metric: str | None = None
    maximize: bool | None = None
    targets: list[float] = field(default_factory=list)
    curves: Curves | None = None
    final: FinalMetrics | None = None
    best_test_metric: float | None = None
    steps_to_target: list[int | None] = field(default_factory=list)
    time_to_target: list[float | None] = field(default_factory=list)
    steps_taken: int | None = None
    resumed_from_step: int | None = None
    train_time: float | None = None
    step_time: StepTime | None = None
    memory: MemoryReading | None = None
    divergence: str | None = None
    at_chance_level: bool = False
    device: str | None = None
    device_name: str | None = None
    num_threads: int | None = None
    torch_version: str | None = None
    num_parameters: int | None = None
    world_size: int = 1
    communication_per_step: float | None = None
    config: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    job_dir: str | None = field(default=None, compare=False)
    resumed: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        """Check the status.

        Raises:
            ValueError: If ``status`` is not one of :data:`STATUSES`.
        """
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}.")

    @property
    def diverged(self) -> bool:
        """Whether the run counts as diverged."""
        return self.divergence is not None

    @property
    def trained(self) -> bool:
        """Whether the job trained (its curves and timings are set)."""
        return self.curves is not None

    @property
    def extended_from(self) -> dict[str, Any] | None:
        """How the grid extension added this job (``None``: in the sweep's grid)."""
        return self.config.get("extended_from")

    @property
    def result_file(self) -> Path:
        """The absolute path of ``result.json``.

        Raises:
            ValueError: If the result was neither read nor written.
        """
        if self.job_dir is None:
            raise ValueError("This result was neither read from nor written to disk.")
        return (Path(self.job_dir) / RESULT_FILE).resolve()

    def to_json(self) -> dict[str, Any]:
        """The record as strict-JSON data (the layout of ``result.json``).

        Returns:
            Plain data; non-finite floats become ``None``.
        """
        data = dataclasses.asdict(self)
        del data["job_dir"], data["resumed"]
        data["best"] = {"test_metric": data.pop("best_test_metric")}
        data["diverged"] = self.diverged
        return finite_or_none(data)

    @classmethod
    def from_json(cls, data: dict[str, Any], job_dir: str | None = None) -> RunResult:
        """Read the record from the data of a ``result.json``.

        Args:
            data: As written by :meth:`to_json`.
            job_dir: The file's directory.

        Returns:
            The record.
        """
        data = dict(data)
        data.pop("diverged", None)
        # Files written before the flag: the chance rule's reason says it.
        data.setdefault(
            "at_chance_level",
            (data.get("divergence") or "").startswith("final test accuracy"),
        )
        best = data.pop("best", None) or {}
        nested = {
            "curves": Curves,
            "final": FinalMetrics,
            "step_time": StepTime,
            "memory": MemoryReading,
        }
        for key, kind in nested.items():
            if data.get(key) is not None:
                data[key] = kind(**data[key])
        return cls(**data, best_test_metric=best.get("test_metric"), job_dir=job_dir)

    def write(self, job_dir: Path) -> Path:
        """Write ``result.json`` atomically into ``job_dir``; remember the directory.

        Args:
            job_dir: The job's directory (created if missing).

        Returns:
            The file's path.
        """
        data = self.to_json()
        path = write_atomically(
            job_dir / RESULT_FILE, lambda stream: json.dump(data, stream, indent=1)
        )
        self.job_dir = str(job_dir)
        return path

    @classmethod
    def read(cls, path: Path) -> RunResult:
        """Read a ``result.json``.

        Args:
            path: The file.

        Returns:
            The record, with ``job_dir`` its directory.
        """
        with open(path) as f:
            return cls.from_json(json.load(f), job_dir=str(Path(path).parent))


def finite_or_none(value: Any) -> Any:
    """Replace non-finite floats (recursively) by ``None`` for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value
