"""DampedNewton under PyTorch Lightning's ``Trainer.fit``, against the plain loop.

A Lightning run and the README's closure loop over the same batches, from the same
parameters with the same seed, must end bitwise equal: Lightning passes its closure
(``training_step``, ``zero_grad``, ``backward``) to ``optimizer.step``, and the
optimizer runs it in its BackPACK context as any other closure.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from tests.ecosystem.lightning_setup import (
    BATCHES_PER_EPOCH,
    TRAINER_SETTINGS,
    Classifier,
    make_loader,
    plain_loop,
)
from tests.utils import assert_parameters_equal, assert_same_state

STEPS = 12  # refreshes at steps 0, 1, 3, 7 and frozen steps in between


def fit(module: Classifier, steps: int, **trainer_settings) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=steps, **{**TRAINER_SETTINGS, **trainer_settings})
    trainer.fit(module, make_loader())
    return trainer


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_fit_equals_the_closure_loop(manual):
    module = Classifier(manual=manual)
    trainer = fit(module, STEPS)
    model, optimizer, losses = plain_loop(STEPS)
    assert trainer.global_step == STEPS
    assert module.losses == losses
    assert_parameters_equal(list(module.model.parameters()), list(model.parameters()))
    assert_same_state(trainer.optimizers[0].state_dict(), optimizer.state_dict())
    # Six steps on four batches: the second pass over the data has a lower loss.
    assert sum(losses[-2:]) < sum(losses[:2]), losses


@pytest.mark.parametrize(
    ("algorithm", "clip"),
    [
        ("norm", torch.nn.utils.clip_grad_norm_),
        ("value", torch.nn.utils.clip_grad_value_),
    ],
)
def test_gradient_clipping_clips_grad_after_the_closures_backward(algorithm, clip):
    """Lightning clips ``.grad`` once the closure's backward pass has run.

    DampedNewton reads that clipped ``.grad``; BackPACK's curvature is unclipped.
    """
    module = Classifier()
    fit(module, STEPS, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)

    def clip_after_backward(model: nn.Module) -> None:
        clip(model.parameters(), 0.05)

    model, _, losses = plain_loop(STEPS, after_backward=clip_after_backward)
    assert module.losses == losses
    assert_parameters_equal(list(module.model.parameters()), list(model.parameters()))
    unclipped, _, _ = plain_loop(STEPS)
    assert not torch.equal(next(model.parameters()), next(unclipped.parameters())), (
        "the clipping had no effect: raise the gradient norm or lower the bound"
    )


def test_norm_clipping_scales_the_step_by_the_clipping_factor():
    """The step is linear in ``.grad`` for fixed curvature: it shrinks by ``c/‖ḡ‖``.

    Constant damping, no trust region and no weight decay, so nothing else depends on
    the slopes or moves the parameters.
    """
    settings = {"damping": 0.1, "kl_clip": None, "weight_decay": 0.0}
    start = [p.detach().clone() for p in plain_loop(0)[0].parameters()]
    unclipped = [p.detach() for p in plain_loop(1, **settings)[0].parameters()]
    norms: list[float] = []

    def clip_after_backward(model: nn.Module) -> None:
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))

    clipped = plain_loop(1, after_backward=clip_after_backward, **settings)[0]
    (norm,) = norms
    assert norm > 0.05, "raise the gradient norm or lower the bound"
    for before, after, reference in zip(
        start, clipped.parameters(), unclipped, strict=True
    ):
        expected = (reference - before) * (0.05 / (norm + 1e-6))  # torch's clip factor
        torch.testing.assert_close(
            after.detach() - before, expected, rtol=1e-10, atol=0
        )


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_a_closure_that_accumulates_micro_batches_takes_the_batch_step(micro_batches):
    """Lightning's route to accumulation: manual optimization, one closure.

    The closure back-propagates each micro-batch's loss times its share of the batch
    (uneven for 3 of 8 samples); with the exact GGN every step, refreshes and steps
    between them, equals the plain loop's on the whole batch.
    """
    module = Classifier(manual=True, micro_batches=micro_batches, mc_samples=0)
    fit(module, STEPS)
    model, _, losses = plain_loop(STEPS, mc_samples=0)
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(losses))
    pairs = zip(module.model.parameters(), model.parameters(), strict=True)
    for after, expected in pairs:
        torch.testing.assert_close(after, expected, rtol=1e-10, atol=1e-12)


def test_accumulate_grad_batches_is_refused():
    """Lightning accumulates by skipping ``zero_grad`` before the stepping closure.

    The error names the option and the closure pattern that accumulates instead.
    """
    with pytest.raises(
        RuntimeError, match=r"accumulate_grad_batches=1 and accumulate micro-batches"
    ):
        fit(Classifier(), STEPS, accumulate_grad_batches=2)


def test_autocast_precision_is_refused_with_what_to_do():
    """``precision="bf16-mixed"`` autocasts the closure: float32 layers, bf16 outputs.

    The error points to half-precision weights, which is ``precision="bf16-true"``.
    """
    module = Classifier()
    module.model.float()
    trainer = pl.Trainer(max_steps=1, precision="bf16-mixed", **TRAINER_SETTINGS)
    with pytest.raises(RuntimeError, match=r"closure runs under torch\.autocast"):
        trainer.fit(module, make_loader(torch.float32))


def checkpointing(directory) -> ModelCheckpoint:
    """Keep a checkpoint at the end of every epoch, named by the epoch."""
    return ModelCheckpoint(
        dirpath=directory, every_n_epochs=1, save_top_k=-1, filename="{epoch}"
    )


def test_model_checkpoint_resumes_bitwise(tmp_path):
    """Fit 2 epochs with ModelCheckpoint, resume to 3: equal to 3 epochs at once."""
    first_epochs, total_epochs = 2, 3
    settings = {**TRAINER_SETTINGS, "enable_checkpointing": True}
    pl.Trainer(
        max_epochs=first_epochs, callbacks=[checkpointing(tmp_path / "a")], **settings
    ).fit(Classifier(), make_loader())
    path = tmp_path / "a" / f"epoch={first_epochs - 1}.ckpt"
    assert path.exists(), sorted(p.name for p in (tmp_path / "a").iterdir())

    resumed = Classifier()
    resumed_trainer = pl.Trainer(
        max_epochs=total_epochs, callbacks=[checkpointing(tmp_path / "a")], **settings
    )
    resumed_trainer.fit(resumed, make_loader(), ckpt_path=path)

    uninterrupted = Classifier()
    whole = pl.Trainer(max_epochs=total_epochs, **TRAINER_SETTINGS)
    whole.fit(uninterrupted, make_loader())

    assert resumed_trainer.global_step == whole.global_step
    assert whole.global_step == total_epochs * BATCHES_PER_EPOCH
    # The resumed run trained the last epoch only, with the same losses.
    assert 0 < len(resumed.losses) < len(uninterrupted.losses)
    assert resumed.losses == uninterrupted.losses[-len(resumed.losses) :]
    assert_parameters_equal(
        list(resumed.parameters()), list(uninterrupted.parameters())
    )
    assert_same_state(
        resumed_trainer.optimizers[0].state_dict(), whole.optimizers[0].state_dict()
    )


class SkippingClassifier(Classifier):
    """Skips every batch of index 1 (Lightning: ``training_step`` returns None)."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            return None
        return super().training_step(batch, batch_idx)


def test_a_batch_skipped_by_training_step_takes_no_step():
    """The run equals the closure loop over the batches that were not skipped."""
    module = SkippingClassifier()
    fit(module, STEPS)
    model, optimizer, losses = plain_loop(STEPS, skip=lambda step: step % 4 == 1)
    assert module.losses == losses
    assert_parameters_equal(list(module.model.parameters()), list(model.parameters()))
    assert_same_state(
        module.optimizers().optimizer.state_dict(), optimizer.state_dict()
    )
