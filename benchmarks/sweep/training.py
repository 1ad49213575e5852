"""The training loop: timed optimizer steps, untimed evaluations.

Only the optimizer step (batch gather, forward, backward, ``optimizer.step``) is timed;
evaluations run between the timed intervals, so the wall-clock axis, time-to-target
and the per-step time exclude them.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from benchmarks.measure import Stopwatch
from benchmarks.problems.problems import Problem, Protocol
from benchmarks.sweep.checkpointing import Checkpointing
from benchmarks.sweep.data_parallel import DataParallel

CREATE_GRAPH_WARNING = r"Using backward\(\) with create_graph=True"
"""torch's warning on the parameter↔gradient cycle that ``create_graph=True`` leaves;
the closure's ``zero_grad()`` (set_to_none) breaks it before every backward pass."""


@dataclass(frozen=True)
class OptimizerNeeds:
    """How the training loop must drive an optimizer (``optimizer_needs`` in config).

    Attributes:
        backpack: Extend model and loss function with BackPACK before building the
            optimizer (only then: extension adds hooks that cost time).
        closure: Call ``optimizer.step(closure)``; otherwise the loop runs the
            closure itself and then calls ``optimizer.step()``.
        create_graph: Back-propagate with ``create_graph=True`` (Hessian-vector
            products, e.g. AdaHessian).
    """

    backpack: bool = False
    closure: bool = False
    create_graph: bool = False


@dataclass
class Curves:
    """Evaluations along training (one entry per evaluation).

    Attributes:
        step: Optimizer steps taken.
        time: Training wall-clock seconds so far (evaluations excluded).
        train_loss: Loss on the training-evaluation samples.
        test_loss: Loss on the test set.
        test_metric: Test metric (accuracy, or the test loss for ``metric: loss``).
    """

    step: list[int] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    test_loss: list[float] = field(default_factory=list)
    test_metric: list[float] = field(default_factory=list)


@dataclass
class TrainingLog:
    """What one training run produced.

    Attributes:
        curves: The evaluations.
        step_times: Wall-clock seconds of every step taken.
        at_chance_level: The run counts as diverged because it ended at chance
            level, not because its loss blew up (a budget too short to learn).
        divergence: Why the run counts as diverged (``None``: it did not); see
            :func:`train`.
        steps_to_target: Per target of the protocol, the first evaluated step whose
            test metric reached it (``None``: never).
        time_to_target: Training seconds at those steps.
        resumed_from_step: The checkpoint's step this run continued from (``None``:
            it started at step 0).
    """

    curves: Curves = field(default_factory=Curves)
    step_times: list[float] = field(default_factory=list)
    divergence: str | None = None
    at_chance_level: bool = False
    steps_to_target: list[int | None] = field(default_factory=list)
    time_to_target: list[float | None] = field(default_factory=list)
    resumed_from_step: int | None = None

    @property
    def diverged(self) -> bool:
        """Whether the run counts as diverged."""
        return self.divergence is not None

    def median_step_time(self, warmup_steps: int) -> float | None:
        """Median step time without the first ``warmup_steps`` steps."""
        times = self.step_times[warmup_steps:]
        return statistics.median(times) if times else None


def mini_batches(
    num_samples: int, batch_size: int, generator: torch.Generator, device: torch.device
) -> Iterator[Tensor]:
    """Endless mini-batch indices: reshuffle every epoch, drop the incomplete batch.

    Args:
        num_samples: Size of the training set.
        batch_size: Indices per batch.
        generator: Source of the permutations.
        device: Device of the returned index tensors.

    Yields:
        Index tensors of length ``batch_size``.
    """
    while True:
        perm = torch.randperm(num_samples, generator=generator).to(device)
        for start in range(0, num_samples - batch_size + 1, batch_size):
            yield perm[start : start + batch_size]


@torch.no_grad()
def evaluate(
    problem: Problem, x: Tensor, y: Tensor, batch_size: int
) -> tuple[float, float | None]:
    """Mean loss and accuracy of the model on ``(x, y)``, in batches.

    Args:
        problem: The problem (model and loss function).
        x: Inputs.
        y: Targets.
        batch_size: Samples per forward pass.

    Returns:
        ``(loss, accuracy)``; the accuracy is ``None`` for non-integer targets.
    """
    total_loss, correct = 0.0, 0
    classify = not y.is_floating_point()
    for start in range(0, x.shape[0], batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        out = problem.model(xb)
        total_loss += problem.loss_fn(out, yb).item() * xb.shape[0]
        if classify:
            correct += (out.argmax(dim=1) == yb).sum().item()
    num = x.shape[0]
    return total_loss / num, (correct / num if classify else None)


def _step(
    problem: Problem,
    model: nn.Module,
    optimizer: Optimizer,
    needs: OptimizerNeeds,
    index: Tensor,
) -> float:
    """One optimizer step of ``model`` on the mini-batch ``index``; returns its loss."""
    x, y = problem.data.x_train[index], problem.data.y_train[index]
    losses: list[Tensor] = []

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = problem.loss_fn(model(x), y)
        with warnings.catch_warnings():
            # Hessian-vector optimizers (AdaHessian) need the graph; torch warns that
            # it may leak when parameters keep their .grad: they are zeroed above.
            warnings.filterwarnings(
                "ignore", message=CREATE_GRAPH_WARNING, category=UserWarning
            )
            loss.backward(create_graph=needs.create_graph)
        losses.append(loss.detach())
        return loss

    if needs.closure:
        try:
            # torch's stub types closures as returning float; they may return it.
            optimizer.step(closure)  # type: ignore[arg-type]
        except FloatingPointError:
            # DampedNewton refuses a non-finite loss or step (nonfinite="raise"),
            # parameters unchanged: the run diverged, as another optimizer's whose
            # loss turns NaN (on every rank: the ranks agree on the refusal).
            return math.nan
    else:
        closure()
        try:
            optimizer.step()
        except Exception:
            # An optimizer that raises on a non-finite gradient (a NaN matrix's
            # decomposition) diverged, as one whose loss turns NaN; the loss is read
            # only then (one host read a step otherwise, after the step).
            if math.isfinite(losses[0].item()):
                raise
            return math.nan
    return losses[0].item()


def train(
    problem: Problem,
    optimizer: Optimizer,
    needs: OptimizerNeeds,
    batches: Iterator[Tensor],
    stopwatch: Stopwatch,
    data_parallel: DataParallel | None = None,
    checkpointing: Checkpointing | None = None,
    scheduler: LRScheduler | None = None,
) -> TrainingLog:
    """Train for the problem's step budget, evaluating on its schedule.

    The run counts as diverged (``log.divergence`` says why) when a mini-batch or
    evaluated loss is NaN or infinite (or DampedNewton refused a non-finite step),
    or an evaluated train loss exceeds ``protocol.blowup_factor`` times the one at
    step 0 (both stop training), or, for ``metric: accuracy``, the final test
    accuracy is at most :meth:`~benchmarks.problems.problems.Protocol.chance_threshold`
    (chance level plus a margin).

    Args:
        problem: The problem, with model and loss already extended if needed.
        optimizer: The optimizer over the problem's trainable parameters.
        needs: How to call the optimizer.
        batches: Mini-batch indices (see :func:`mini_batches`).
        stopwatch: Timer of the steps (synchronizes CUDA).
        data_parallel: Under ``torchrun``: the model trains wrapped in
            ``DistributedDataParallel`` on this rank's shard of every batch of
            ``batches`` (a global batch); the mini-batch loss is the ranks' mean,
            and every rank evaluates identically, so all take the same decisions.
        checkpointing: Save a checkpoint every ``checkpointing.every`` steps, and
            continue from this job's checkpoint if there is one (one process only;
            see :mod:`benchmarks.sweep.checkpointing`).
        scheduler: Stepped after every optimizer step, untimed
            (:mod:`benchmarks.sweep.schedules`); ``None``: constant learning rates.

    Returns:
        The log.

    Raises:
        ValueError: For checkpoints under ``torchrun``.
    """
    if checkpointing is not None and data_parallel is not None:
        raise ValueError(
            "checkpoint_every works in one process only; set checkpoint_every=null "
            "under torchrun."
        )
    protocol, data = problem.protocol, problem.data
    train_eval = slice(0, protocol.train_eval_samples)
    log = TrainingLog()
    log.steps_to_target = [None] * len(protocol.targets)
    log.time_to_target = [None] * len(protocol.targets)
    elapsed = 0.0
    model = problem.model
    if data_parallel is not None:
        device = next(problem.model.parameters()).device
        model = data_parallel.wrap(problem.model, device)

    def record(step: int) -> str | None:
        """Evaluate and log; return why the run diverged, if it did."""
        problem.model.eval()
        train_loss, _ = evaluate(
            problem,
            data.x_train[train_eval],
            data.y_train[train_eval],
            protocol.eval_batch_size,
        )
        test_loss, accuracy = evaluate(
            problem, data.x_test, data.y_test, protocol.eval_batch_size
        )
        problem.model.train()
        metric = test_loss if protocol.metric == "loss" else accuracy
        if metric is None:
            raise ValueError(
                f"problem.metric={protocol.metric!r} needs integer class labels."
            )
        curves = log.curves
        curves.step.append(step)
        curves.time.append(elapsed)
        curves.train_loss.append(train_loss)
        curves.test_loss.append(test_loss)
        curves.test_metric.append(metric)
        for i, target in enumerate(protocol.targets):
            if log.steps_to_target[i] is None and protocol.reached(metric, target):
                log.steps_to_target[i], log.time_to_target[i] = step, elapsed
        if not (math.isfinite(train_loss) and math.isfinite(test_loss)):
            return f"non-finite evaluated loss at step {step}"
        initial, factor = curves.train_loss[0], protocol.blowup_factor
        if factor is not None and train_loss > factor * initial:
            return (
                f"train loss {train_loss:.4g} > {factor:g} × initial {initial:.4g} "
                f"at step {step}"
            )
        return None

    step = 0
    resumed = checkpointing and checkpointing.restore(problem.model, optimizer)
    if resumed:
        step = resumed.step
        saved = dict(resumed.log)
        log.curves = Curves(**saved.pop("curves"))
        for key, value in saved.items():
            setattr(log, key, value)
        log.resumed_from_step = step
        elapsed = sum(log.step_times)  # the same additions in the same order
        with warnings.catch_warnings():  # torch: "scheduler stepped before optimizer"
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):  # replay the batch order (and schedule) up to it
                next(batches)
                if scheduler is not None:
                    scheduler.step()
    else:
        log.divergence = record(0)
    while not log.diverged and step < protocol.steps:
        step += 1
        index = next(batches)
        if data_parallel is not None:
            index = data_parallel.shard(index)
        stopwatch.start()
        loss = _step(problem, model, optimizer, needs, index)
        seconds = stopwatch.stop()
        if data_parallel is not None:
            loss = data_parallel.mean(loss)
        elapsed += seconds
        log.step_times.append(seconds)
        if scheduler is not None:
            scheduler.step()
        if not math.isfinite(loss):
            log.divergence = f"non-finite mini-batch loss or step at step {step}"
        elif step % protocol.eval_every == 0 or step == protocol.steps:
            log.divergence = record(step)
        if checkpointing and checkpointing.due(step) and step < protocol.steps:
            checkpointing.save(step, problem.model, optimizer, log)
    if not log.diverged and protocol.metric == "accuracy":
        log.divergence = _chance_level(protocol, problem.num_classes, log)
        log.at_chance_level = log.diverged
    return log


def _chance_level(protocol: Protocol, num_classes: int, log: TrainingLog) -> str | None:
    """Why the final test accuracy counts as chance level, or ``None``."""
    threshold = protocol.chance_threshold(num_classes)
    final = log.curves.test_metric[-1]
    if threshold is None or final > threshold:
        return None
    return (
        f"final test accuracy {final:.4g} ≤ {threshold:.4g} (chance 1/{num_classes} "
        f"+ {protocol.chance_margin:g} of the gap to 1)"
    )
