"""BackPACK's module hooks, switched off where no extension runs.

``backpack.extend`` gives every module a forward hook that stores its input and
output and a full backward hook. Outside a ``backpack(...)`` context the hooks do
nothing useful, but they still cost: a full backward hook wraps the module's inputs
and outputs in extra autograd nodes (on an MLP the plain forward and backward pass
took 2.8× as long with them). :class:`ExtendedModules` records the extended modules
a BackPACK pass ran through, and suspends their two hooks for a pass without
extensions (the steps between curvature refreshes); every other hook stays. In both
kinds of pass the loss modules' inputs are checked to be module outputs, not results
of an operation between the model and the loss, which BackPACK's quantities (keyed
by memory address) cannot pass: :func:`check_loss_input`.
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

from dampednewton.backpack.unsupported import (
    LOSS_INPUT_NOT_MODEL_OUTPUT,
    LOSS_INPUT_OF_EARLIER_FORWARD,
    LOSS_INPUT_PART_OF_OUTPUT,
    LOSS_INPUT_REARRANGED_OUTPUT,
)

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
        """The modules whose output a loss module took in a recorded pass (of a
        container and its last layer, which share the output, the container), over
        all recorded passes: a model with several heads that take turns has each
        head that a refresh saw."""

    def __len__(self) -> int:
        """Number of recorded modules still alive."""
        return len(self._modules)

    @contextmanager
    def recording(
        self, on_loss: Callable[[Module, tuple], None] | None = None
    ) -> Iterator[None]:
        """Record every extended module that runs a forward pass inside the block.

        Also records the modules whose outputs the loss modules took
        (:attr:`loss_sources`), and refuses a loss that took a module's output
        through an operation (:func:`check_loss_input`).

        Args:
            on_loss: Called with each extended loss module and its inputs after its
                forward pass.

        Yields:
            Nothing; run the closure inside.
        """
        outputs = ModuleOutputs()

        def record(module: Module, inputs: tuple, output: Tensor) -> None:
            if not getattr(module, EXTENDED_FLAG, False):
                return
            self._modules.add(module)
            if isinstance(module, _BatchNorm):
                self.batch_norms.add(module)
            if isinstance(module, _Loss):
                source = check_loss_input(module, inputs, outputs)
                if source is not None:
                    self.loss_sources.add(source)
                if on_loss is not None:
                    on_loss(module, inputs)
            else:
                outputs.add(module, inputs, output)

        handle = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            yield
        finally:
            handle.remove()

    @contextmanager
    def checking_loss_inputs(self) -> Iterator[Callable[[Module, tuple], None]]:
        """Note the outputs of :attr:`loss_sources` inside the block.

        Yields:
            ``check(loss, inputs)``: :func:`check_loss_input` against those outputs.
            An input of another origin (a head that no refresh saw feed a loss)
            passes: the next refresh's pass checks it.
        """
        outputs = ModuleOutputs()
        handles = [
            module.register_forward_hook(outputs.add) for module in self.loss_sources
        ]

        def check(loss: Module, inputs: tuple) -> None:
            check_loss_input(loss, inputs, outputs)

        try:
            yield check
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


GRAPH_SEARCH_LIMIT = 32
"""Autograd nodes searched from a loss's input for a module's output (the operations
between a model and its loss are few)."""


class ModuleOutputs:
    """The outputs of the modules seen in one pass: their addresses and nodes.

    The autograd nodes are held until the pass ends (they are the graph's anyway).
    """

    def __init__(self) -> None:
        """Start with no output."""
        self.modules: dict[int, Module] = {}
        """The last module (a container after its last layer) of each address."""
        self.layouts: dict[int, tuple[torch.Size, tuple[int, ...]]] = {}
        """The shape and strides of that module's output."""
        self.latest: dict[int, int] = {}
        """Each module's (by ``id``) latest output with gradients, by address."""
        self._nodes: dict[int, Any] = {}

    def add(self, module: Module, inputs: tuple, output: Any) -> None:
        """Note a module's output (a forward hook's signature)."""
        if isinstance(output, Tensor):
            address = output.data_ptr()
            self.modules[address] = module
            self.layouts[address] = (output.shape, output.stride())
            if output.requires_grad:
                self.latest[id(module)] = address
            if output.grad_fn is not None:
                self._nodes[id(output.grad_fn)] = output.grad_fn

    def computed_from(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s autograd graph reaches one of the outputs (bounded)."""
        frontier = [tensor.grad_fn]
        for _ in range(GRAPH_SEARCH_LIMIT):
            if not frontier:
                return False
            node = frontier.pop(0)
            if node is None:
                continue
            if id(node) in self._nodes:
                return True
            frontier.extend(following for following, _ in node.next_functions)
        return False


def check_loss_input(
    loss: Module, inputs: tuple, outputs: ModuleOutputs
) -> Module | None:
    """Refuse a loss whose input was computed from a module's output by an operation.

    BackPACK keys what it back-propagates by the memory of the loss's input and of
    each module's output: the output itself and its views pass, ``model(x) / 2`` or
    ``model(x)[keep]`` reach no module (BackPACK's error, or a wrong shape where a
    freed address was reused), and a slice or a rearranged view that starts at the
    output's memory (``model(x)[:16]``, ``model(x).transpose(1, 2)``) reaches it in
    another layout.

    Args:
        loss: The loss module after its forward pass.
        inputs: Its inputs.
        outputs: The outputs of the modules seen in the pass.

    Returns:
        The module whose output the loss took, if it is among ``outputs``.

    Raises:
        RuntimeError: For an input computed from one of ``outputs``, a part or
            rearrangement of one, or the output of a forward pass after which the
            module ran another with gradients (BackPACK keeps the last one's).
    """
    if not inputs or not isinstance(inputs[0], Tensor):
        return None
    address = inputs[0].data_ptr()
    source = outputs.modules.get(address)
    if source is None and outputs.computed_from(inputs[0]):
        raise RuntimeError(LOSS_INPUT_NOT_MODEL_OUTPUT.format(loss=type(loss).__name__))
    if source is None:
        return None
    if outputs.latest.get(id(source), address) != address:
        raise RuntimeError(
            LOSS_INPUT_OF_EARLIER_FORWARD.format(loss=type(loss).__name__)
        )
    shape, strides = outputs.layouts[address]
    taken = inputs[0]
    # A squeeze (an (N, 1) output as (N,)) is the loss checks' to refuse, by name.
    squeezed = [size for size in taken.shape if size != 1] == [
        size for size in shape if size != 1
    ]
    if not squeezed and (taken.shape != shape or taken.stride() != strides):
        message = (
            LOSS_INPUT_PART_OF_OUTPUT
            if taken.numel() != shape.numel()
            else LOSS_INPUT_REARRANGED_OUTPUT
        )
        raise RuntimeError(
            message.format(
                loss=type(loss).__name__,
                taken=tuple(taken.shape),
                output=tuple(shape),
            )
        )
    return source


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
