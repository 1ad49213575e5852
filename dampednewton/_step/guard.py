"""What makes a refused step leave no trace: the non-finite policy and rollbacks.

A step is refused when its loss, its curvature or its update is not finite. Refusing
means: parameters, optimizer state and the Monte-Carlo generator exactly as before
the step. :class:`GeneratorSnapshot` puts the generator back; :func:`nonfinite_problem`
says what is wrong; :func:`refuse` raises or warns according to the policy
(``nonfinite='raise'`` or ``'skip'``).
"""

from __future__ import annotations

import warnings
from types import TracebackType

from torch import Generator, Tensor

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


def check_loss_type(loss: object) -> None:
    """Refuse a closure that did not return the loss tensor.

    Args:
        loss: What the closure returned.

    Raises:
        TypeError: If it is not a tensor.
    """
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"The closure must return the loss tensor, got {type(loss).__name__}."
        )


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
