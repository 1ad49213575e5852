"""What the optimizer wraps around the closure's backward pass.

* :class:`SingleBackwardCheck` makes sure the closure ran at most one backward pass
  into zeroed gradients: BackPACK's curvature describes one backward pass, ``.grad``
  accumulates over all of them, and a step that mixes the two is silently wrong.
* :func:`quiet_backward_hook_warning` silences torch's "Full backward hook is firing
  ..." warning, which BackPACK's module hooks trigger on every backward pass whose
  first layer gets inputs that need no gradient (the usual case).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType

import torch
from torch import Tensor

FULL_BACKWARD_HOOK_WARNING = (
    r"Full backward hook is firing when gradients are computed with respect to "
    r"module outputs since no inputs require gradients"
)


@contextmanager
def quiet_backward_hook_warning() -> Iterator[None]:
    """Ignore torch's full-backward-hook warning inside the block, nothing else.

    Yields:
        Nothing; run the backward pass (the closure) inside.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=FULL_BACKWARD_HOOK_WARNING, category=UserWarning
        )
        yield


class SingleBackwardCheck:
    """Context that counts the gradients reaching parameters and checks stale ``.grad``.

    Inside the context, every trainable parameter carries a hook that runs when a
    backward pass delivers its gradient, before accumulation into ``.grad``: it counts
    the deliveries and records whether ``.grad`` already held non-zero values
    (gradients from before the closure, or from an earlier backward pass in it). The
    hooks are removed on exit. Besides the hooks, the check costs one reduction per
    parameter whose ``.grad`` is not ``None`` and one device synchronization; with
    ``zero_grad()`` (``set_to_none=True``) it reads no gradient at all.

    Example:
        >>> import torch
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> with SingleBackwardCheck([weight]) as check:
        ...     (weight.sum() * 2).backward()
        >>> check.problem() is None
        True
    """

    def __init__(self, params: Iterable[Tensor]):
        """Remember the parameters to watch.

        Args:
            params: Parameters; those that do not require gradients are skipped.
        """
        self._params = [p for p in params if p.requires_grad]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._passes = [0] * len(self._params)
        self._stale: list[Tensor] = []

    def __enter__(self) -> SingleBackwardCheck:
        """Attach the hooks.

        Returns:
            The check itself.
        """
        self._handles = [
            param.register_hook(self._hook(index, param))
            for index, param in enumerate(self._params)
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Remove the hooks (also after an exception)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def problem(self) -> str | None:
        """What was wrong with the backward passes inside the context, if anything.

        Returns:
            ``None`` after at most one backward pass into zeroed (or ``None``)
            gradients, else a sentence that says what happened and what to do.
        """
        passes = max(self._passes, default=0)
        if passes > 1:
            return (
                f"the closure ran {passes} backward passes into the parameters' .grad. "
                "The curvature comes from the last pass while .grad sums all of them, "
                "so the step would be wrong. Call backward() once per closure (for "
                "gradient accumulation, concatenate the micro-batches into one batch "
                "or use another optimizer)"
            )
        if self._stale and bool(torch.stack(self._stale).any()):
            return (
                "the parameters' .grad held values from before the closure's backward "
                "pass, so .grad is not this batch's gradient. Zero the gradients at "
                "the start of the closure (optimizer.zero_grad())"
            )
        return None

    def _hook(self, index: int, param: Tensor) -> Callable[[Tensor], None]:
        """The hook of one parameter: count the pass, flag a non-zero ``.grad``."""

        def before_accumulation(incoming: Tensor) -> None:
            self._passes[index] += 1
            if param.grad is not None:
                self._stale.append(param.grad.detach().any())

        return before_accumulation
