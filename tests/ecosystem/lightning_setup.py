"""A tiny float64 classifier as a ``LightningModule``, and its plain-loop twin.

Both train the same BackPACK-extended MLP on the same batches with a ``DampedNewton``
of the same settings, so a Lightning run can be compared bitwise with the closure
loop the README documents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from backpack import extend
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from dampednewton import DampedNewton
from tests.utils import seeded

BATCH_SIZE, BATCHES_PER_EPOCH = 8, 4
OPTIMIZER_SETTINGS: dict[str, Any] = {"seed": 0}
"""DampedNewton's defaults (adaptive damping, Monte-Carlo GGN, averaging), seeded."""

TRAINER_SETTINGS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def make_model() -> nn.Module:
    """The MLP, float64, parameters from a fixed local generator."""
    generator = torch.Generator().manual_seed(0)
    mlp = seeded(
        lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), generator
    )
    return extend(mlp)


def make_batches() -> list[tuple[Tensor, Tensor]]:
    """One epoch of float64 batches of a 3-class problem, in a fixed order."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(
        BATCH_SIZE * BATCHES_PER_EPOCH, 4, generator=generator, dtype=torch.float64
    )
    targets = (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0.5).long()
    return list(zip(inputs.split(BATCH_SIZE), targets.split(BATCH_SIZE), strict=True))


def make_loader(dtype: torch.dtype = torch.float64) -> DataLoader:
    """The batches of :func:`make_batches` as Lightning's training data."""
    inputs, targets = (torch.cat(parts) for parts in zip(*make_batches(), strict=True))
    return DataLoader(TensorDataset(inputs.to(dtype), targets), batch_size=BATCH_SIZE)


class Classifier(pl.LightningModule):
    """Cross-entropy classifier trained by DampedNewton.

    Attributes:
        model: The extended MLP.
        loss_fn: The extended cross-entropy loss.
        losses: The loss of every closure call (training_step), in order.
    """

    def __init__(
        self, manual: bool = False, micro_batches: int = 1, **optimizer_settings: Any
    ):
        """Build the model.

        Args:
            manual: Manual optimization (``opt.step(closure)`` in training_step).
            micro_batches: Manual optimization: the closure accumulates the batch's
                gradient over this many micro-batches, each loss weighted by its
                share of the batch (docs/accumulation.md).
            **optimizer_settings: Overrides of :data:`OPTIMIZER_SETTINGS`.
        """
        super().__init__()
        self.model = make_model()
        self.loss_fn = extend(nn.CrossEntropyLoss())
        self.automatic_optimization = not manual
        self.micro_batches = micro_batches
        self.optimizer_settings = {**OPTIMIZER_SETTINGS, **optimizer_settings}
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        """The batch's loss (automatic), or a whole DampedNewton step (manual)."""
        inputs, targets = batch
        if self.automatic_optimization:
            loss = self.loss_fn(self.model(inputs), targets)
            self.losses.append(loss.item())
            return loss
        optimizer = self.optimizers()

        def closure() -> Tensor:
            optimizer.zero_grad()
            loss = inputs.new_zeros(())
            for x, y in zip(
                inputs.tensor_split(self.micro_batches),
                targets.tensor_split(self.micro_batches),
                strict=True,
            ):
                part = self.loss_fn(self.model(x), y) * (len(y) / len(targets))
                self.manual_backward(part)
                loss = loss + part.detach()
            self.losses.append(loss.item())
            return loss

        optimizer.step(closure)
        return None

    def configure_optimizers(self) -> DampedNewton:
        """DampedNewton on all parameters."""
        return DampedNewton(self.parameters(), **self.optimizer_settings)


def plain_loop(
    steps: int,
    after_backward: Callable[[nn.Module], object] | None = None,
    skip: Callable[[int], bool] | None = None,
    **optimizer_settings: Any,
) -> tuple[nn.Module, DampedNewton, list[float]]:
    """Train the same model on the same batches with the README's closure loop.

    Args:
        steps: Optimizer steps (the batches repeat epoch after epoch).
        after_backward: Called with the model after ``loss.backward()`` (clipping).
        skip: Whether to skip the batch of a step (no step taken).
        **optimizer_settings: Overrides of :data:`OPTIMIZER_SETTINGS`.

    Returns:
        The model, the optimizer and the loss of every closure call.
    """
    model = make_model()
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(
        model.parameters(), **{**OPTIMIZER_SETTINGS, **optimizer_settings}
    )
    losses: list[float] = []
    for step, (inputs, targets) in enumerate(_cycle(make_batches(), steps)):
        if skip is not None and skip(step):
            continue

        def closure(inputs: Tensor = inputs, targets: Tensor = targets) -> Tensor:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            if after_backward is not None:
                after_backward(model)
            losses.append(loss.item())
            return loss

        optimizer.step(closure)
    return model, optimizer, losses


def _cycle(
    batches: list[tuple[Tensor, Tensor]], steps: int
) -> Iterator[tuple[Tensor, Tensor]]:
    for step in range(steps):
        yield batches[step % len(batches)]
