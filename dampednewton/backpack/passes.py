"""One BackPACK backward pass shared by several consumers.

Computations and diagnostics each bring extensions and an ``extension_hook`` that
reduces a module's BackPACK quantities as backward reaches it. One pass serves them
all (one extension per savefield, which the caller picks): :func:`chained` runs the
hooks in order and then frees the quantities of the module's parameters, so per-sample
tensors live for one layer only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from backpack import backpack
from backpack.extensions.backprop_extension import BackpropExtension
from torch.nn import Module
from torch.nn.modules.loss import _Loss

from dampednewton.backpack.backward import quiet_backward_hook_warning
from dampednewton.backpack.loss_checks import check_reduction

Hook = Callable[[Module], None]
"""BackPACK's ``extension_hook``: runs on each module after its extensions."""


def free_quantities(module: Module, savefields: Iterable[str]) -> None:
    """Delete the BackPACK quantities ``savefields`` of a module's own parameters.

    Args:
        module: The module backward just reached.
        savefields: Attribute names to delete where present.
    """
    savefields = tuple(savefields)
    for param in module.parameters(recurse=False):
        for savefield in savefields:
            if hasattr(param, savefield):
                delattr(param, savefield)


def chained(hooks: Sequence[Hook | None], savefields: Iterable[str]) -> Hook:
    """One hook that runs ``hooks`` in order, then frees ``savefields``.

    Args:
        hooks: Hooks of the consumers (``None`` entries are skipped); each may read
            the quantities, none deletes those the next one needs.
        savefields: Quantities to free once every hook ran on the module.

    Returns:
        The hook to pass as ``extension_hook``; it also refuses a loss module that
        does not average over the batch, which every consumer assumes.
    """
    active = [hook for hook in hooks if hook is not None]
    savefields = tuple(savefields)

    def run_then_free(module: Module) -> None:
        if isinstance(module, _Loss):
            check_reduction(module)
        for hook in active:
            hook(module)
        free_quantities(module, savefields)

    return run_then_free


@contextmanager
def backward_pass(
    extensions: Sequence[BackpropExtension], hooks: Sequence[Hook | None]
) -> Iterator[None]:
    """Context for ``loss.backward()`` with the extensions and chained hooks.

    Every quantity of ``extensions`` is freed layer by layer, after the hooks ran.

    Args:
        extensions: Extensions of one pass, one per savefield.
        hooks: The consumers' hooks, in order.

    Yields:
        Nothing; run the backward pass inside.
    """
    hook = chained(hooks, (extension.savefield for extension in extensions))
    with quiet_backward_hook_warning(), backpack(*extensions, extension_hook=hook):
        yield
