"""BackPACK's module hooks, switched off where no extension runs.

``backpack.extend`` gives every module a forward hook that stores its input and
output and a full backward hook. Outside a ``backpack(...)`` context the hooks do
nothing useful, but they still cost: a full backward hook wraps the module's inputs
and outputs in extra autograd nodes (on an MLP the plain forward and backward pass
took 2.8× as long with them). :class:`ExtendedModules` records the extended modules
a BackPACK pass ran through, and suspends their two hooks for a pass without
extensions (the steps between curvature refreshes); every other hook stays. It also
records which modules' outputs the loss modules took in that pass, so that a pass
without extensions can refuse an operation between the model and the loss, which
BackPACK's pass would have refused (its quantities are keyed by the output's memory).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from backpack import hook_run_extensions, hook_store_io
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.loss import _Loss

EXTENDED_FLAG = "_backpack_extend"
"""The attribute ``backpack.extend`` sets on the modules it gave hooks."""


class ExtendedModules:
    """The BackPACK-extended modules seen in recorded forward passes (weakly held)."""

    def __init__(self) -> None:
        """Start with no module."""
        self._modules: weakref.WeakSet[Module] = weakref.WeakSet()
        self.batch_norms: weakref.WeakSet[Module] = weakref.WeakSet()
        """The recorded BatchNorm layers (checked to be in eval mode every step)."""
        self.unseen_losses = False
        """Whether a pass ran a loss module that no recorded pass saw (then every
        extended loss module is watched: torch's global hook slows every module's
        call, so only then)."""
        self.loss_sources: weakref.WeakSet[Module] = weakref.WeakSet()
        """The modules whose output a loss module took in the last recorded pass
        that ran one (of a container and its last layer, which share the output,
        the container)."""

    def __len__(self) -> int:
        """Number of recorded modules still alive."""
        return len(self._modules)

    @contextmanager
    def recording(
        self, on_loss: Callable[[Module, tuple], None] | None = None
    ) -> Iterator[None]:
        """Record every extended module that runs a forward pass inside the block.

        Also records the modules whose outputs the loss modules took
        (:attr:`loss_sources`), where a loss module ran.

        Args:
            on_loss: Called with each extended loss module and its inputs after its
                forward pass.

        Yields:
            Nothing; run the closure inside.
        """
        # BackPACK holds every extended module's output during its pass, so no
        # address is reused before the loss runs.
        outputs: dict[int, list[Module]] = {}
        sources: list[Module] = []
        losses = 0

        def record(module: Module, inputs: tuple, output: Tensor) -> None:
            nonlocal losses
            if not getattr(module, EXTENDED_FLAG, False):
                return
            self._modules.add(module)
            if isinstance(module, _BatchNorm):
                self.batch_norms.add(module)
            if isinstance(module, _Loss):
                losses += 1
                if inputs and isinstance(inputs[0], Tensor):
                    fed = outputs.get(inputs[0].data_ptr())
                    if fed:  # the outermost module (a container's last layer shares it)
                        sources.append(fed[-1])
                if on_loss is not None:
                    on_loss(module, inputs)
            elif isinstance(output, Tensor):
                outputs.setdefault(output.data_ptr(), []).append(module)

        handle = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            yield
        finally:
            handle.remove()
            if losses:
                self.loss_sources = weakref.WeakSet(sources)

    @contextmanager
    def tracking_outputs(self) -> Iterator[Callable[[tuple], bool]]:
        """Note the outputs of :attr:`loss_sources` inside the block.

        Yields:
            ``fed_by_model(inputs)``: whether a loss module's ``inputs`` start with
            one of those outputs (by memory address, as BackPACK's pass keys its
            quantities: a view of the output passes, ``model(x) / 2`` does not);
            always true when no recorded pass saw a loss take a module's output.
        """
        sources = list(self.loss_sources)
        seen: set[int] = set()

        def note(module: Module, inputs: tuple, output: Any) -> None:
            if isinstance(output, Tensor):
                seen.add(output.data_ptr())

        def fed_by_model(inputs: tuple) -> bool:
            if not sources:
                return True
            return bool(inputs) and (
                isinstance(inputs[0], Tensor) and inputs[0].data_ptr() in seen
            )

        handles = [module.register_forward_hook(note) for module in sources]
        try:
            yield fed_by_model
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Remove BackPACK's hooks from the recorded modules inside the block.

        The hooks are put back in their places on exit, also after an error.

        Yields:
            Nothing; run a pass without BackPACK extensions inside.
        """
        removed = [
            (hooks, _pop(hooks, function))
            for module in list(self._modules)
            for hooks, function in (
                (module._forward_hooks, hook_store_io),
                (module._backward_hooks, hook_run_extensions),
            )
        ]
        try:
            yield
        finally:
            for hooks, entries in removed:
                _restore(hooks, entries)

    @contextmanager
    def watching_losses(
        self, watch: Callable[[Module, tuple[Tensor, ...], Any], None]
    ) -> Iterator[None]:
        """Call ``watch(module, inputs, output)`` after each forward of a recorded loss.

        After :attr:`unseen_losses` was set, every extended loss module is watched.

        Args:
            watch: The callback (it may raise to refuse the pass).

        Yields:
            Nothing; run the closure inside.
        """
        if self.unseen_losses:

            def watch_extended(module: Module, inputs: tuple, output: Tensor) -> None:
                if isinstance(module, _Loss) and getattr(module, EXTENDED_FLAG, False):
                    watch(module, inputs, output)

            handles = [
                torch.nn.modules.module.register_module_forward_hook(watch_extended)
            ]
        else:
            handles = [
                module.register_forward_hook(
                    lambda module, inputs, output: watch(module, inputs, output)
                )
                for module in list(self._modules)
                if isinstance(module, _Loss)
            ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _pop(hooks: dict, function: object) -> dict:
    """Remove the entries of ``hooks`` that are ``function``; return them."""
    found = {key: hook for key, hook in hooks.items() if hook is function}
    if len(found) == len(hooks):
        hooks.clear()
        return found
    for key in found:
        del hooks[key]
    return found


def _restore(hooks: dict, removed: dict) -> None:
    """Put ``removed`` back into ``hooks`` in the order of their (increasing) keys."""
    if not removed:
        return
    if not hooks:  # nothing else was registered: no order to merge into
        hooks.update(removed)
        return
    merged = sorted([*hooks.items(), *removed.items()], key=lambda item: item[0])
    hooks.clear()
    hooks.update(merged)
