"""What makes a refused step leave no trace: the non-finite policy and rollbacks.

A step is refused when its loss, its curvature or its update is not finite. Refusing
means: parameters, optimizer state and the Monte-Carlo generator exactly as before
the step. :class:`GeneratorSnapshot` puts the generator back; :func:`nonfinite_problem`
says what is wrong; :func:`refuse` raises or warns according to the policy
(``nonfinite='raise'`` or ``'skip'``). :class:`StepRollback` undoes a step that raised
after it moved the parameters (an adaptive damping's second closure call failed).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
from torch import Generator, Tensor

from dampednewton._step.active_monitor import ActiveMonitor
from dampednewton._step.step_status import StepStatus

# Warnings of the pipeline's helpers point at the user's call: helper,
# Pipeline.step, DampedNewton.step, and the profiling wrapper that torch.optim puts
# around every optimizer's step.
STACKLEVEL_OF_CALLER = 5


class GeneratorSnapshot:
    """The state of a random generator, put back on :meth:`restore` or on an error.

    Used as a context manager, an exception inside the block restores the state, so
    that a refused step does not consume random draws.

    Example:
        >>> import torch
        >>> generator = torch.Generator().manual_seed(0)
        >>> with GeneratorSnapshot(generator) as snapshot:
        ...     first = torch.rand(1, generator=generator)
        ...     snapshot.restore()
        >>> bool(torch.rand(1, generator=generator) == first)
        True
    """

    def __init__(self, generator: Generator | None):
        """Remember the generator's state.

        Args:
            generator: The generator, or ``None`` (nothing to restore).
        """
        self._saved = None if generator is None else (generator, generator.get_state())

    def restore(self) -> None:
        """Put the remembered state back."""
        if self._saved is not None:
            generator, state = self._saved
            generator.set_state(state)

    def __enter__(self) -> GeneratorSnapshot:
        """Enter the block.

        Returns:
            The snapshot.
        """
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Restore the state if the block raised."""
        if exc_type is not None:
            self.restore()


def nonfinite_problem(
    loss: Tensor, status: StepStatus, eigensolver_succeeded: bool
) -> str | None:
    """What is not finite about a step, if anything.

    Args:
        loss: The closure's loss.
        status: The step's checks, read on the host.
        eigensolver_succeeded: Whether every group's eigensolver succeeded.

    Returns:
        ``None`` if the step can be taken, else the reason.
    """
    if not status.loss_finite:
        return f"the loss is {loss.item()}"
    if not status.model_output_finite:
        return (
            "the model output is not finite, so the loss Hessian cannot be sampled "
            "(Monte-Carlo GGN)"
        )
    curvature_finite = all(g is None or g.curvature_finite for g in status.groups)
    if not (curvature_finite and eigensolver_succeeded):
        return (
            "the damped Newton step is not finite (the GGN is not finite or its "
            "eigendecomposition failed)"
        )
    if not status.step_finite:
        return "the damped Newton step is not finite"
    return None


def check_not_inference_mode() -> None:
    """Refuse a step inside ``torch.inference_mode()``, where nothing back-propagates.

    Raises:
        RuntimeError: Inside inference mode.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "DampedNewton.step was called inside torch.inference_mode(), where the "
            "closure cannot back-propagate: call step outside of it."
        )


class ClosureReturnedNone(TypeError):
    """The closure returned ``None`` instead of the loss.

    Without a backward pass, Lightning's way to skip a batch (``training_step``
    returning ``None``): the step is skipped (:attr:`skipped`), as ``torch.optim``
    skips parameters without gradients. After a backward pass a mistake (a missing
    ``return``), raised to the caller.
    """

    def __init__(self, message: str, skipped: bool) -> None:
        """Keep whether the closure ran no backward pass (the batch is skipped)."""
        super().__init__(message)
        self.skipped = skipped


BACKPROPAGATED_NONE = (
    "The closure must return the loss tensor, got None after a backward pass (a "
    "missing `return loss`?)."
)


def check_loss_type(loss: object) -> Tensor:
    """Refuse a closure that did not return the loss tensor.

    Args:
        loss: What the closure returned.

    Returns:
        The loss.

    Raises:
        TypeError: If it is not a tensor.
        ValueError: If it is not a single number.
    """
    if loss is None:  # the closure ran no backward pass (else refused before)
        raise ClosureReturnedNone("The closure skipped its batch.", skipped=True)
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"The closure must return the loss tensor, got {type(loss).__name__}."
        )
    if loss.dim() != 0:
        raise ValueError(
            "The closure must return the mean loss, a tensor of one number, got "
            f"shape {tuple(loss.shape)}: use the loss function's reduction='mean'."
        )
    return loss


def refuse(
    problem: str, nonfinite: str, stacklevel: int = STACKLEVEL_OF_CALLER
) -> None:
    """Refuse a step: raise for ``'raise'``, warn for ``'skip'``.

    Args:
        problem: What is not finite (from :func:`nonfinite_problem`).
        nonfinite: The policy, ``'raise'`` or ``'skip'``.
        stacklevel: Of the warning: the default points at the user's call when
            ``refuse`` is called from ``Pipeline.step``.

    Raises:
        FloatingPointError: For ``nonfinite='raise'``.
    """
    message = f"DampedNewton refused the update: {problem}; parameters unchanged."
    if nonfinite == "raise":
        raise FloatingPointError(
            message + " Pass nonfinite='skip' to skip such steps with a warning."
        )
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


class StepRollback:
    """What a step may change, remembered so that a step that raises changes nothing.

    Without ``full``, only the keys a step adds to the state are remembered: a step
    that raises before it moves the parameters has changed nothing else, but looking
    up a parameter's state creates its (empty) entry. With ``full`` (a step whose
    adaptive damping calls the closure again after the parameters moved), the
    parameters, the state and the generator are copied first: one more copy of the
    optimizer's memory for that step.

    Args:
        params: Every parameter of the optimizer.
        state: The optimizer's per-parameter state (restored in place).
        records: Its step counters and group statistics (restored in place).
        step: The step counter before the step.
        generator: The Monte-Carlo generator, if created (``full`` only).
        full: Whether to copy everything.
        monitor: The diagnostics monitor active at the step (its record and draws
            are undone too).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        state: dict[Any, Any],
        records: dict[str, Any],
        step: int,
        generator: Generator | None,
        full: bool,
        monitor: ActiveMonitor | None = None,
    ) -> None:
        """Remember the state's and the records' keys, and everything with ``full``."""
        self._monitor = monitor
        self._dicts = (state, records)
        self._step = step
        self._keys = [set(state), set(records)]
        self._params = list(params)
        self._copies: tuple[list[Tensor], list[dict[Any, Any]], Any] | None = None
        if full:
            kept = {id(p): p for p in self._params}  # references, not copies
            self._copies = (
                [p.detach().clone() for p in self._params],
                [
                    {key: copy.deepcopy(value, kept) for key, value in entries.items()}
                    for entries in self._dicts
                ],
                None if generator is None else (generator, generator.get_state()),
            )

    def restore(self, step: int) -> bool:
        """Undo the step.

        Args:
            step: The step counter now.

        Returns:
            Whether the state was replaced (then caches built from it are stale).
        """
        if self._monitor is not None:
            self._monitor.rewind()
        if self._copies is not None:
            values, saved, generator = self._copies
            with torch.no_grad():
                for param, value in zip(self._params, values, strict=True):
                    param.copy_(value)
            for live, copied in zip(self._dicts, saved, strict=True):
                live.clear()
                live.update(copied)
            if generator is not None:
                generator[0].set_state(generator[1])
            return True
        if step == self._step:  # nothing was committed: drop what lookups added
            for live, keys in zip(self._dicts, self._keys, strict=True):
                for key in set(live) - keys:
                    del live[key]
        return False
