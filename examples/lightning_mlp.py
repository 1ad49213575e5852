"""DampedNewton under PyTorch Lightning: ``python examples/lightning_mlp.py [LOG_DIR]``.

A ``LightningModule`` whose ``configure_optimizers`` returns ``DampedNewton``: Lightning
passes its closure (``training_step``, ``zero_grad``, ``backward``) to
``optimizer.step``, which runs it in its BackPACK context. The optimizer's monitor
writes GSNR, gradient histograms and the step's eigenvalues to the run's TensorBoard
log (``tensorboard --logdir LOG_DIR``; a temporary folder without LOG_DIR). Needs
``pip install "dampednewton[lightning,tensorboard]"``.
"""

from __future__ import annotations

import sys
import tempfile

import lightning.pytorch as pl
import torch
from backpack import extend
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dampednewton import DampedNewton
from dampednewton.diagnostics import (
    GSNR,
    DiagnosticsLog,
    DiagnosticsMonitor,
    EveryKSteps,
    GradientHistogram,
    LightningLoggerSink,
)

SAMPLES, BATCH_SIZE, EPOCHS = 512, 64, 8


class MLP(pl.LightningModule):
    """A 3-class tanh MLP trained by DampedNewton, its diagnostics to the logger."""

    def __init__(self) -> None:
        """Build the extended model and loss function."""
        super().__init__()
        self.model = extend(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3)))
        self.loss_fn = extend(nn.CrossEntropyLoss())  # reduction="mean"
        self.epoch_losses: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        """The batch's loss; Lightning runs backward and optimizer.step."""
        inputs, targets = batch
        loss = self.loss_fn(self.model(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        """Keep the loss of the batch's step, per epoch."""
        if batch_idx == 0:
            self.epoch_losses.append([])
        self.epoch_losses[-1].append(outputs["loss"].item())

    def configure_optimizers(self):
        """DampedNewton with a monitor that writes to the trainer's logger."""
        self.diagnostics = DiagnosticsLog(sinks=[LightningLoggerSink(self.logger)])
        monitor = DiagnosticsMonitor(
            [GSNR(schedule=EveryKSteps(4)), GradientHistogram(schedule=EveryKSteps(4))],
            self.model.named_parameters(),
            log=self.diagnostics,
        )
        return DampedNewton(self.parameters(), seed=0, monitor=monitor)

    def on_train_end(self):
        """Hand the last diagnostics record to the logger."""
        self.diagnostics.flush()


def data() -> DataLoader:
    """A synthetic 3-class problem, shuffled by a local generator."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(SAMPLES, 10, generator=generator)
    targets = (inputs[:, :3].sum(1) > 0).long() + (inputs[:, 3] > 1).long()
    return DataLoader(
        TensorDataset(inputs, targets),
        batch_size=BATCH_SIZE,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
    )


def main(log_dir: str, seed: int = 0) -> tuple[float, float]:
    """Train; return the mean loss of the first and of the last epoch."""
    torch.manual_seed(seed)  # the model's initialization
    module = MLP()
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(log_dir, name="lightning_mlp"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, data())
    first, last = (sum(ls) / len(ls) for ls in module.epoch_losses[:: EPOCHS - 1])
    print(f"mean loss: epoch 1 {first:.4f}, epoch {EPOCHS} {last:.4f}")
    print(f"{len(module.diagnostics)} diagnostics records in {trainer.logger.log_dir}")
    return first, last


if __name__ == "__main__":
    torch.set_num_threads(1)
    first, last = main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    assert last < first / 3, (first, last)  # seeds 0-4: 0.16-0.22 of the first
