"""A benchmark problem: model, loss, data and the protocol settings, from config.

A ``problem`` config (``conf/problem/*.yaml``) holds three instantiable nodes
(``data``, ``model``, ``loss``) and the protocol: batch size, step budget, evaluation
schedule, the test metric, the target values that count as "reached" (an easier and a
harder one) and the divergence rule's knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from benchmarks.problems.data import Dataset

#: Test metrics and whether larger values are better.
METRICS: dict[str, bool] = {"accuracy": True, "loss": False}


@dataclass(frozen=True)
class Protocol:
    """How a problem is trained and evaluated.

    Attributes:
        metric: ``"accuracy"`` (higher is better) or ``"loss"`` (lower is better),
            measured on the test set.
        targets: Test-metric values that count as reached, easier first (may be
            empty).
        batch_size: Mini-batch size.
        steps: Number of optimizer steps.
        eval_every: Evaluate every that many steps (and at step 0 and the end).
        eval_batch_size: Batch size of the (untimed) evaluation passes.
        train_eval_samples: Training samples used to evaluate the training loss (the
            first ones; ``None``: all).
        blowup_factor: A run diverges when an evaluated train loss exceeds this
            factor times the train loss at step 0 (``None``: no such rule).
        chance_margin: For ``metric: accuracy``, a run diverges when its final test
            accuracy is at most chance plus this fraction of the gap from chance to
            1: ``c + chance_margin · (1 − c)`` with ``c = 1 / num_classes``
            (``None``: no such rule).
    """

    metric: str
    targets: tuple[float, ...]
    batch_size: int
    steps: int
    eval_every: int
    eval_batch_size: int = 4096
    train_eval_samples: int | None = None
    blowup_factor: float | None = 10.0
    chance_margin: float | None = 0.15

    def __post_init__(self) -> None:
        """Validate the settings."""
        if self.metric not in METRICS:
            raise ValueError(
                f"problem.metric must be one of {sorted(METRICS)}, got {self.metric!r}."
            )
        for name in ("batch_size", "steps", "eval_every", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"problem.{name} must be >= 1, got {getattr(self, name)}."
                )
        if self.train_eval_samples is not None and self.train_eval_samples < 1:
            raise ValueError(
                "problem.train_eval_samples must be >= 1 or null (all), got "
                f"{self.train_eval_samples}."
            )
        if self.blowup_factor is not None and self.blowup_factor <= 1:
            raise ValueError(
                f"problem.blowup_factor must be > 1 or null, got {self.blowup_factor}."
            )
        if self.chance_margin is not None and not 0 <= self.chance_margin < 1:
            raise ValueError(
                "problem.chance_margin must be in [0, 1) or null, got "
                f"{self.chance_margin}."
            )
        ordered = sorted(self.targets, reverse=not self.maximize)
        if list(self.targets) != ordered:
            raise ValueError(
                f"problem.targets must go from easier to harder ({self.metric}: "
                f"{'increasing' if self.maximize else 'decreasing'}), got "
                f"{list(self.targets)}."
            )

    def chance_threshold(self, num_classes: int) -> float | None:
        """Final accuracy at or below which a run counts as diverged (``None``: off)."""
        if self.chance_margin is None:
            return None
        chance = 1 / num_classes
        return chance + self.chance_margin * (1 - chance)

    @property
    def maximize(self) -> bool:
        """Whether larger values of the metric are better."""
        return METRICS[self.metric]

    def reached(self, value: float, target: float) -> bool:
        """Whether a test-metric value reaches ``target``."""
        return value >= target if self.maximize else value <= target


@dataclass
class Problem:
    """Everything one training run needs, on its device.

    Attributes:
        name: Problem name (``problem.name``).
        model: The model (not yet BackPACK-extended).
        loss_fn: Loss module with ``reduction="mean"``.
        data: Training and test tensors.
        protocol: Training and evaluation settings.
    """

    name: str
    model: nn.Module
    loss_fn: nn.Module
    data: Dataset
    protocol: Protocol

    def __post_init__(self) -> None:
        """Check the batch size against the training set."""
        num_train = self.data.x_train.shape[0]
        if self.protocol.batch_size > num_train:
            raise ValueError(
                f"problem.batch_size={self.protocol.batch_size} exceeds the "
                f"{num_train} training samples of {self.name}."
            )

    @property
    def num_classes(self) -> int:
        """Number of classes of a classification problem (largest label + 1)."""
        return int(self.data.y_train.max()) + 1

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters with ``requires_grad`` (what the optimizer receives)."""
        return [p for p in self.model.parameters() if p.requires_grad]


def build_problem(
    cfg: DictConfig,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> Problem:
    """Instantiate a problem config on ``device``.

    Args:
        cfg: The ``problem`` node.
        device: Device of the data and the model.
        dtype: Floating-point type of the data and the model.
        generator: Source of the model's initial parameters.

    Returns:
        The problem.
    """
    protocol = Protocol(
        metric=cfg.metric,
        targets=tuple(cfg.targets),
        batch_size=cfg.batch_size,
        steps=cfg.steps,
        eval_every=cfg.eval_every,
        eval_batch_size=cfg.eval_batch_size,
        train_eval_samples=cfg.train_eval_samples,
        blowup_factor=cfg.blowup_factor,
        chance_margin=cfg.chance_margin,
    )
    data = instantiate(cfg.data).to(device, dtype)
    model = instantiate(cfg.model, generator=generator).to(device=device, dtype=dtype)
    return Problem(
        name=cfg.name,
        model=model,
        loss_fn=instantiate(cfg.loss),
        data=data,
        protocol=protocol,
    )
