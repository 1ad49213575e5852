"""The closure's run: its backward passes checked, BackPACK's modules recorded."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from dampednewton._step.guard import BACKPROPAGATED_NONE, ClosureReturnedNone
from dampednewton.backpack.backward import BackwardCheck, quiet_backward_hook_warning
from dampednewton.backpack.hooks import ExtendedModules
from dampednewton.backpack.loss_checks import DeferredChecks, check_plain_loss_call
from dampednewton.backpack.passes import Hook, backward_pass
from dampednewton.backpack.unsupported import NO_LOSS_MODULE, check_batch_norms_in_eval
from dampednewton.distributed import UNKNOWN_BATCH_SIZE, Communicator

CLOSURE_PATTERN = """\
    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    loss = optimizer.step(closure)"""


def run_closure(
    closure: Callable[[], Any],
    params: Sequence[Tensor],
    extensions: list,
    hooks: Sequence[Hook],
    modules: ExtendedModules | None = None,
    accumulation: bool = True,
    deferred: DeferredChecks | None = None,
) -> Any:
    """Run the closure's backward passes with the extensions (if any) and the hooks.

    All BackPACK quantities are freed layer by layer, after the hooks ran. The
    closure may accumulate gradients over micro-batches (see
    :class:`~dampednewton.backpack.backward.BackwardCheck`).

    Args:
        closure: ``zero_grad``, forward, ``backward``; returns the loss.
        params: Every parameter of the optimizer.
        extensions: BackPACK extensions; none: a plain backward pass.
        hooks: The consumers' extension hooks, in order.
        modules: Records the extended modules of a pass with extensions and
            suspends their BackPACK hooks in a pass without (then the loss
            modules' forward passes count the micro-batches and check the loss's
            options and targets, as the extensions do in a pass with them).
        accumulation: Whether several backward passes (micro-batches) may run.
        deferred: Where a pass without extensions leaves the targets' check for
            the step's host read (``None``: check at once); every pass counts the
            loss modules' samples into it (its ``local_samples``).

    Returns:
        What the closure returned.

    Raises:
        RuntimeError: When the closure back-propagated something else than its
            micro-batches' losses, a graph twice, or did not zero the gradients.
        ValueError: For a loss option BackPACK's GGN does not support.
    """
    plain = not extensions and modules is not None and len(modules) > 0
    with (
        torch.enable_grad(),
        quiet_backward_hook_warning(),
        BackwardCheck(params) as check,
    ):
        if plain:
            assert modules is not None

            def watch(module: Module, inputs: tuple[Tensor, ...], output: Any) -> None:
                check.count_forward(module, output)
                check_plain_loss_call(module, inputs, deferred)
                check_batch_norms_in_eval(modules.batch_norms)
                check_loss_input(module, inputs)

            with (
                modules.suspended(),
                modules.checking_loss_inputs() as check_loss_input,
                modules.watching_losses(watch),
            ):
                loss = closure()
            if check.micro_batches == 0 and loss is not None:
                if modules.unseen_losses:  # every extended loss module was watched
                    raise RuntimeError(NO_LOSS_MODULE)
                # The loss module is new (or created in the closure): watch every
                # extended one from the next pass on.
                modules.unseen_losses = True
        else:
            with (
                backward_pass(extensions, [*hooks, check.module_hook]),
                recording(modules, deferred),
            ):
                loss = closure()
    # A closure that returns None without a backward pass skips its batch.
    if loss is None and check.ran_backward:
        raise ClosureReturnedNone(BACKPROPAGATED_NONE, skipped=False)
    problem = None if loss is None else check.problem(accumulation)
    if problem is not None:
        raise RuntimeError(
            f"DampedNewton refused the step: {problem}; parameters and optimizer "
            f"state unchanged. The closure should be\n{CLOSURE_PATTERN}"
        )
    return loss


def recording(
    modules: ExtendedModules | None, deferred: DeferredChecks | None
) -> AbstractContextManager:
    """``modules.recording()`` counting the loss modules' samples into ``deferred``."""
    if modules is None:
        return nullcontext()

    def count(module: Module, inputs: tuple) -> None:
        if deferred is not None and inputs and isinstance(inputs[0], Tensor):
            deferred.local_samples += inputs[0].shape[0]

    return modules.recording(count)


@contextmanager
def failure_shared(communicator: Communicator | None) -> Iterator[None]:
    """Tell the other ranks when the closure inside raises, then raise.

    The other ranks wait for this one's pass (:meth:`Communicator.agree_on_pass`);
    told that it failed, they raise too instead of waiting.

    Args:
        communicator: The ranks' collectives (``None``: one process, nothing to tell).

    Yields:
        Nothing; run the closure inside.
    """
    try:
        yield
    except Exception:
        if communicator is not None:
            communicator.agree_on_pass(
                math.nan, UNKNOWN_BATCH_SIZE, failed=True, check_sizes=False
            )
        raise
