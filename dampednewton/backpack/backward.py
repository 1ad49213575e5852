"""What the optimizer wraps around the closure's backward passes.

* :class:`BackwardCheck` makes sure the closure's backward passes went into zeroed
  gradients and that each of them back-propagated a micro-batch's loss of its own
  forward pass (gradient accumulation): BackPACK's curvature describes the forward
  passes whose loss module it reached, ``.grad`` accumulates over every backward
  pass, and a step that mixes the two is silently wrong.
* :func:`check_fresh_forward` refuses a backward pass through a module whose
  forward inputs BackPACK no longer holds: the same graph back-propagated a second
  time (``retain_graph=True``), or several forward passes before their backward
  passes.
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
from torch.nn import Module
from torch.nn.modules.loss import _Loss

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


ACCUMULATION_PATTERN = """\
    def closure():
        optimizer.zero_grad()
        total = 0.0
        for inputs, targets in micro_batches:  # forward, then backward, in turn
            loss = loss_fn(model(inputs), targets) * len(inputs) / batch_size
            loss.backward()
            total = total + loss.detach()
        return total"""


class RepeatedBackward(RuntimeError):
    """A backward pass reached a module whose forward pass was back-propagated."""


def check_fresh_forward(module: Module) -> None:
    """Refuse a module's backward pass without a forward pass of its own.

    BackPACK stores a module's inputs and output in its forward pass and deletes
    them once the module's backward pass ran, so a module without them is being
    back-propagated a second time.

    Args:
        module: A BackPACK-extended module during a backward pass.

    Raises:
        RepeatedBackward: If BackPACK holds no forward output of the module.
    """
    if not hasattr(module, "output"):
        raise RepeatedBackward(
            "DampedNewton refused the step: a backward pass reached "
            f"{type(module).__name__} whose forward pass was already back-propagated "
            "(the same graph twice, e.g. loss.backward(retain_graph=True) and "
            "loss.backward(), or the forward passes of several micro-batches before "
            "their backward passes), is used twice in one forward pass (BackPACK "
            "needs one module instance per use) or ran inside backpack.disable(); "
            "parameters and "
            "optimizer state unchanged. Run one forward and one backward pass per "
            "micro-batch, in turn:\n" + ACCUMULATION_PATTERN
        )


class BackwardCheck:
    """Context that checks the backward passes of a closure.

    Inside the context, every trainable parameter carries a hook that runs when a
    backward pass delivers its gradient, before accumulation into ``.grad``: it counts
    the deliveries and records, at the first one, whether ``.grad`` already held
    non-zero values (gradients from before the closure). :meth:`module_hook` (a
    BackPACK ``extension_hook``) counts the backward passes that started at a loss
    module (the micro-batches) and refuses modules back-propagated twice
    (:func:`check_fresh_forward`). Several backward passes are gradient accumulation
    when each of them started at the loss. The hooks are removed on exit. Besides
    them, the check costs one reduction per parameter whose ``.grad`` is not
    ``None`` and one device synchronization; with ``zero_grad()``
    (``set_to_none=True``) it reads no gradient at all.

    Attributes:
        micro_batches: Backward passes that started at a loss module so far.

    Example:
        >>> import torch
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> with BackwardCheck([weight]) as check:
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
        self._loss_backwards = 0  # backward passes seen to start at a loss module
        self.micro_batches = 0

    def __enter__(self) -> BackwardCheck:
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

    @property
    def ran_backward(self) -> bool:
        """Whether a backward pass reached a parameter or started at a loss."""
        return self.passes > 0 or self._loss_backwards > 0

    @property
    def passes(self) -> int:
        """The most backward passes that delivered a gradient to one parameter."""
        return max(self._passes, default=0)

    def module_hook(self, module: Module) -> None:
        """BackPACK ``extension_hook``: count micro-batches, refuse repeated passes.

        Args:
            module: The module that backward just reached.
        """
        check_fresh_forward(module)
        if isinstance(module, _Loss):
            self.micro_batches += 1
            self._loss_backwards += 1

    def count_forward(self, module: Module, output: object = None) -> None:
        """Count a micro-batch at a loss module's forward pass.

        Passes without BackPACK's hooks (between curvature refreshes) count the
        micro-batches here instead of in :meth:`module_hook`: a graph
        back-propagated twice then has more backward passes than forward ones.
        A hook on the loss counts the backward passes that start there.

        Args:
            module: The loss module that ran.
            output: Its output, the loss.
        """
        if isinstance(module, _Loss):
            self.micro_batches += 1
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(self._count_loss_backward)

    def _count_loss_backward(self, _grad: Tensor) -> None:
        self._loss_backwards += 1

    def problem(self, accumulation: bool = True) -> str | None:
        """What was wrong with the backward passes inside the context, if anything.

        Args:
            accumulation: Whether several backward passes (micro-batches) may run.

        Returns:
            ``None`` after backward passes into zeroed (or ``None``) gradients that
            each started at a loss module (or after a single one), else a sentence
            that says what happened and what to do (also when no backward pass
            reached any parameter).
        """
        passes = self.passes
        if passes == 0 and self._params and self._loss_backwards == 0:
            return (
                "the closure ran no backward pass (no parameter was reached, and no "
                "backward pass started at the loss). Call loss.backward() in the "
                "closure"
            )
        if passes > 1 and not accumulation:
            return (
                f"the closure ran {passes} backward passes (gradient accumulation) at "
                "a step whose diagnostics monitor is active, which describes one "
                "backward pass. Step without the monitor, or with one backward pass "
                "per closure at the monitor's steps"
            )
        if passes > 1 and self._loss_backwards > self.micro_batches:
            return (  # without BackPACK's hooks, which refuse it at the modules
                "a backward pass reached a loss whose forward pass was already "
                "back-propagated (the same graph twice, e.g. "
                "loss.backward(retain_graph=True) and loss.backward()). Run one "
                "forward and one backward pass per micro-batch, in turn"
            )
        if passes > 1 and self.micro_batches != passes:
            return (
                f"the closure ran {passes} backward passes into the parameters' "
                f".grad, but {self.micro_batches} of them started at a BackPACK-"
                "extended loss module, so .grad holds gradients whose curvature the "
                "step does not know. Back-propagate only the micro-batches' losses "
                "(one backward pass each, loss module extended with backpack.extend)"
                ", add a regularizer to the loss instead of back-propagating it "
                "separately"
            )
        if passes >= 1 and self._loss_backwards > passes:
            return (
                f"one backward pass started at {self._loss_backwards} losses (the "
                "forward passes of several micro-batches before one backward pass), "
                "whose curvature BackPACK cannot tell apart. Run one forward and one "
                "backward pass per micro-batch, in turn (docs/accumulation.md)"
            )
        if self._stale and bool(torch.stack(self._stale).any()):
            return (
                "the parameters' .grad held values from before the closure's backward "
                "pass, so .grad is not this batch's gradient. Zero the gradients at "
                "the start of the closure (optimizer.zero_grad()). Under PyTorch "
                "Lightning this is Trainer(accumulate_grad_batches > 1), whose earlier "
                "batches the curvature never sees: keep accumulate_grad_batches=1 and "
                "accumulate micro-batches inside one closure (docs/accumulation.md)"
            )
        return None

    def _hook(self, index: int, param: Tensor) -> Callable[[Tensor], None]:
        """The hook of one parameter: count the pass, flag a stale ``.grad``."""

        def before_accumulation(incoming: Tensor) -> None:
            self._passes[index] += 1
            if self._passes[index] == 1 and param.grad is not None:
                self._stale.append(param.grad.detach().any())

        return before_accumulation
