"""Checkpoints of a long job: save every N steps, resume bit-identically.

With ``checkpoint_every: N`` (config key; ``null``: off),
:func:`benchmarks.sweep.training.train` saves ``checkpoint.pt`` in the job directory
after every N-th step (after that step's evaluation, if any), atomically
(:mod:`benchmarks.sweep.atomic`). It holds the model's and the optimizer's state dicts
(``DampedNewton``'s includes its Monte-Carlo generator), the global torch RNG states
(CPU and CUDA: BackPACK's and AdaHessian's draws), the step counter, the training log
so far (curves, step times, targets reached) and the job's config. A rerun of the
same job finds it, checks that it is this job's (same config) and continues from its
step: the batch order is replayed from the seeded generator up to that step, so every
later batch, draw and update is the one the uninterrupted run takes. The job deletes
the checkpoint once its ``result.json`` is written (kept for a failed job, whose rerun
resumes). One process only (not under ``torchrun``).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from benchmarks.sweep.atomic import write_atomically

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class Resumed:
    """What a checkpoint restores besides model and optimizer.

    Attributes:
        step: Optimizer steps taken.
        log: The :class:`~benchmarks.sweep.training.TrainingLog` fields as plain data.
    """

    step: int
    log: dict[str, Any]


@dataclass
class Checkpointing:
    """Where and how often a job saves its checkpoint.

    Attributes:
        job_dir: The job directory (the file is ``checkpoint.pt`` in it).
        every: Steps between checkpoints (>= 1).
        config: The job's resolved config; a checkpoint of another config is not
            resumed.
    """

    job_dir: Path
    every: int
    config: dict[str, Any]

    def __post_init__(self) -> None:
        """Check ``every``.

        Raises:
            ValueError: If ``every`` is not a positive integer.
        """
        if isinstance(self.every, bool) or not isinstance(self.every, int):
            raise ValueError(
                f"checkpoint_every must be an integer, got {self.every!r}."
            )
        if self.every < 1:
            raise ValueError(
                f"checkpoint_every must be >= 1 (null turns it off), got {self.every}."
            )

    @property
    def path(self) -> Path:
        """The checkpoint file."""
        return self.job_dir / CHECKPOINT_FILE

    def due(self, step: int) -> bool:
        """Whether to save after ``step``."""
        return step % self.every == 0

    def save(self, step: int, model: nn.Module, optimizer: Optimizer, log: Any) -> None:
        """Save the training state after ``step`` (atomically).

        Args:
            step: Optimizer steps taken.
            model: The model.
            optimizer: The optimizer.
            log: The :class:`~benchmarks.sweep.training.TrainingLog` so far.
        """
        state = {
            "config": self.config,
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "cpu_rng": torch.get_rng_state(),
            "cuda_rng": (
                torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
            ),
            "log": dataclasses.asdict(log),
        }
        write_atomically(
            self.path, lambda stream: torch.save(state, stream), binary=True
        )

    def restore(self, model: nn.Module, optimizer: Optimizer) -> Resumed | None:
        """Load this job's checkpoint into model, optimizer and the RNGs, if any.

        Args:
            model: The freshly built model.
            optimizer: The freshly built optimizer.

        Returns:
            The step and log to continue from; ``None`` without a checkpoint of this
            config (an unreadable one or another config's is ignored, with a warning).
        """
        if not self.path.exists():
            return None
        try:
            # Optimizer settings may be policy objects: not weights-only data.
            state = torch.load(self.path, weights_only=False)
        except Exception as error:
            warnings.warn(
                f"{self.path} cannot be read ({error}); training starts over.",
                stacklevel=2,
            )
            return None
        if state.get("config") != self.config:
            warnings.warn(
                f"{self.path} belongs to another config; training starts over.",
                stacklevel=2,
            )
            return None
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["cpu_rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        return Resumed(state["step"], state["log"])

    def remove(self) -> None:
        """Delete the checkpoint (the job's result is written)."""
        self.path.unlink(missing_ok=True)
