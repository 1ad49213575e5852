"""A refresh's Kronecker factors from one ``torch.autograd.grad``, without BackPACK.

BackPACK back-propagates the loss Hessian's Monte-Carlo square root module by module,
in Python, through hooks on every module; the Kronecker factors need it only at the
layers' outputs. :class:`AutogradFactors` draws the square root at the model's output
(the same draws as BackPACK's pass, from the same generator:
:mod:`~dampednewton.backpack.sampled_roots`), back-propagates it with one
``torch.autograd.grad`` per Monte-Carlo sample to the layers' outputs, kept by a
forward hook, before the closure's own backward (K-FAC's usual implementation), and
turns them and the layers' inputs into the factors ``A`` and ``S`` that the BackPACK
pass's :class:`~dampednewton.backpack.kronecker_hook.FactorCollector` produces.

It serves the refreshes after the first (which runs through BackPACK and checks the
model): micro-batches through a cross-entropy, a binary cross-entropy or a squared
error on ``[N, C]`` outputs, the collected parameters in ``nn.Linear`` and unfoldable
convolutions that each run once per loss. Anything else (a layer run twice before a
loss, another loss, micro-batches that reach different layers, a sub-sample of
several micro-batches) leaves the pass without factors
(:meth:`~AutogradFactors.layers` is ``None``): the step keeps the stored bases and the
next refresh runs through BackPACK, which handles (or refuses with its message) every
case. Hooks the user registered on the tensors between the model's output and the
layers' outputs run once more, in this pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Generator, Tensor
from torch.nn import Conv1d, Conv2d, Conv3d, Linear, Module
from torch.nn.modules.loss import _Loss

from dampednewton.backpack.extensions import subsample_beyond_batch_message
from dampednewton.backpack.hooks import EXTENDED_FLAG
from dampednewton.backpack.kronecker_hook import LayerFactors
from dampednewton.backpack.layers import unfoldable
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.private import keeping_stored_io
from dampednewton.backpack.sampled_roots import (
    SAMPLED_LOSSES,
    mean_normalization,
    sampled_gradients,
)
from dampednewton.math.kronecker_factors import input_factor, output_factor
from dampednewton.math.patches import conv_patches
from dampednewton.math.precision import upcast

Owned = tuple[Tensor | None, Tensor | None]
"""A layer's collected ``(weight, bias)`` (``None``: not collected)."""

NOT_COVERED = (None, None)
"""What :func:`layer_owned` returns for a module that holds collected parameters the
pass cannot serve."""


def layer_owned(module: Module, wanted: set[int]) -> Owned | None:
    """The collected parameters a module holds, if any.

    Args:
        module: A module whose forward pass ran.
        wanted: The ``id`` of every parameter whose factors the refresh needs.

    Returns:
        ``None`` for a module without such parameters; its ``(weight, bias)`` for an
        ``nn.Linear`` or unfoldable convolution that holds nothing else of them;
        :data:`NOT_COVERED` for any other module that holds some.
    """
    own = [p for p in module.parameters(recurse=False) if id(p) in wanted]
    if not own:
        return None
    if not isinstance(module, Linear | Conv1d | Conv2d | Conv3d) or (
        not isinstance(module, Linear) and not unfoldable(module)
    ):
        return NOT_COVERED
    weight = module.weight if id(module.weight) in wanted else None
    bias = (
        module.bias if module.bias is not None and id(module.bias) in wanted else None
    )
    if len(own) != (weight is not None) + (bias is not None):
        return NOT_COVERED
    return weight, bias


def layer_rows(
    module: Module, inputs: Tensor, backproped: Tensor
) -> tuple[Tensor, Tensor]:
    """A layer's inputs ``[N, (P,) d_in]`` and square root ``[C, N, (P,) d_out]``.

    Args:
        module: An ``nn.Linear`` or unfoldable convolution.
        inputs: Its forward input.
        backproped: The square root at its output, ``[C, N, *output.shape[1:]]``.

    Returns:
        The rows of BackPACK's buffers: positions (and unfolded patches) in the
        middle for a weight shared over positions.
    """
    if isinstance(module, Linear):
        if inputs.dim() == 2:
            return inputs, backproped
        return inputs.flatten(1, -2), backproped.flatten(2, -2)
    assert isinstance(module, Conv1d | Conv2d | Conv3d)
    patches = conv_patches(
        inputs,
        module.kernel_size,
        stride=module.stride,
        padding=module.padding,  # type: ignore[arg-type]
        dilation=module.dilation,
    )
    return patches, backproped.flatten(3).transpose(2, 3)


def layer_factors(
    inputs: Tensor, backproped: Tensor, bias: bool, bias_only: bool, batch_size: int
) -> tuple[Tensor, Tensor]:
    """``(A, S)`` of a layer from its rows (:func:`layer_rows`), as BackPACK's pass.

    Args:
        inputs: ``[N', (P,) d_in]`` (the sub-sample's).
        backproped: ``[C, N', (P,) d_out]``.
        bias: Whether the layer's bias is collected with its weight.
        bias_only: Only the bias is collected: ``A = [[1]]``, ``S`` of the square
            root summed over positions.
        batch_size: ``N``, the micro-batch's samples.

    Returns:
        The input and output factors in the computation dtype.
    """
    backproped = upcast(backproped)
    num_samples = backproped.shape[1]
    scale = batch_size / num_samples
    if bias_only:
        summed = backproped.sum(2) if backproped.dim() == 4 else backproped
        ones = backproped.new_zeros(num_samples, 0)
        return input_factor(ones, True, num_samples), output_factor(summed, scale)
    return (
        input_factor(upcast(inputs), bias, num_samples),
        output_factor(backproped, scale),
    )


@dataclass
class MicroBatch:
    """One loss's factors, and the gradient that reached that loss (its weight).

    Attributes:
        factors: Each reached layer's ``(weight, bias, A, S)``, by its first
            parameter's ``id``.
        weights: The gradients that reached the loss output in backward passes.
    """

    factors: dict[int, tuple[Tensor | None, Tensor | None, Tensor, Tensor]]
    weights: list[Tensor] = field(default_factory=list)


class AutogradFactors:
    """A pass's factors through ``torch.autograd.grad``; see the module docstring.

    Each loss's forward pass is one micro-batch (a closure that accumulates
    gradients runs a forward pass and a loss per micro-batch): its factors are taken
    at once, and it enters the batch's factors with the gradient that reached its
    loss in the closure's backward pass, ``N_m/N`` or ``1/M`` (as in BackPACK's pass:
    :class:`~dampednewton.backpack.kronecker_hook.LayerFactors`), recorded in the
    step's deferred checks, which warn when the weights do not sum to 1.

    One global forward hook finds the layers that hold collected parameters
    (:func:`layer_owned`) and the BackPACK-extended loss modules as the closure runs
    them, whichever modules earlier passes saw (a resumed optimizer's first refresh
    takes this pass as the one it was saved from would).

    Args:
        params: The parameters whose factors the refresh needs.
        mc_samples: Monte-Carlo samples of the loss Hessian's square root (≥ 1).
        subsampling: The samples the factors are from (``None``: all).
        generator: The draws' source (``None``: the global random state).
        deferred: Where the model output's finiteness and the losses' weights are
            left for the step's read.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        mc_samples: int,
        subsampling: Sequence[int] | None,
        generator: Generator | None,
        deferred: DeferredChecks,
    ):
        """Start with no micro-batch."""
        self.wanted = {id(param) for param in params}
        self.mc_samples = mc_samples
        self.subsampling = None if subsampling is None else list(subsampling)
        self.generator = generator
        self.deferred = deferred
        self.micro_batches: list[MicroBatch] = []
        self._unsupported = False
        self._owned: dict[Module, Owned | None] = {}
        self._owners: dict[int, Module] = {}  # each collected parameter's module
        self._ran: set[Module] = set()
        self._seen: dict[Module, tuple[Tensor, Tensor]] = {}

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Keep the layers' inputs and outputs of the forward passes inside.

        Yields:
            Nothing; run the closure inside (:meth:`loss_ran` runs after each
            BackPACK-extended loss module's forward pass).
        """
        hook = torch.nn.modules.module.register_module_forward_hook(self._forward)
        try:
            yield
        finally:
            hook.remove()
            self._ran.clear()
            self._seen.clear()

    def _forward(self, module: Module, inputs: tuple, output: object) -> None:
        if isinstance(module, _Loss):
            if getattr(module, EXTENDED_FLAG, False):
                self.loss_ran(module, inputs, output)
            return
        if module not in self._owned:
            self._owned[module] = owned = layer_owned(module, self.wanted)
            for param in () if owned is None else module.parameters(recurse=False):
                if id(param) not in self.wanted:
                    continue
                if self._owners.setdefault(id(param), module) is not module:
                    self._unsupported = True  # tied: one parameter in two modules
        owned = self._owned[module]
        if owned is None:
            return
        if owned is NOT_COVERED:
            self._unsupported = True
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        if module in self._ran:  # twice before a loss: tied, recurrent, auxiliary
            self._unsupported = True
        self._ran.add(module)
        self._seen[module] = (inputs[0].detach(), output)

    def layers(self) -> dict[int, LayerFactors] | None:
        """The layers' factors of the closure's micro-batches (after it).

        Returns:
            Each layer's weighted sums (one micro-batch: its own factors), by its
            first parameter's ``id``; ``None`` where the pass fell short: something
            it does not cover, no loss, or micro-batches that reached different
            layers (BackPACK's pass refuses those).
        """
        passes = [batch for batch in self.micro_batches if batch.weights]
        if self._unsupported or not passes:
            return None
        if any(batch.factors.keys() != passes[0].factors.keys() for batch in passes):
            return None
        layers: dict[int, LayerFactors] = {}
        for batch in passes:
            weight = batch.weights[0]
            self.deferred.add_loss_weight(weight)
            for key, (param, bias, inputs, outputs) in batch.factors.items():
                if key in layers:
                    layers[key].add(inputs, outputs, weight)
                else:
                    layers[key] = LayerFactors(
                        param, bias, inputs, outputs, first_weight=weight
                    )
        return layers

    def loss_ran(self, loss: Module, inputs: tuple, output: object) -> None:
        """Back-propagate the sampled square root from a loss's input to the layers.

        Args:
            loss: A loss module after its forward pass (already checked).
            inputs: Its inputs (the model output first).
            output: The loss (a hook on it records the micro-batch's weight).
        """
        if not isinstance(output, Tensor) or not output.requires_grad:
            return  # outside the graph (a metric under no_grad): no micro-batch
        logits = inputs[0] if inputs else None
        seen = list(self._seen.items())
        self._ran.clear()
        self._seen.clear()  # the activations are the graph's again, freed by backward
        if (
            self._unsupported
            or not isinstance(loss, SAMPLED_LOSSES)
            or not isinstance(logits, Tensor)
            or logits.dim() != 2
            or not logits.requires_grad
            or (self.subsampling is not None and self.micro_batches)
        ):
            self._unsupported = True
            return
        self.deferred.loss_name = str(loss)  # for the warning on the weights
        batch = MicroBatch(self._factors(seen, logits, loss))
        output.register_hook(lambda grad: batch.weights.append(grad.detach()))
        self.micro_batches.append(batch)

    def _factors(
        self, seen: list[tuple[Module, tuple[Tensor, Tensor]]], logits: Tensor, loss
    ) -> dict[int, tuple[Tensor | None, Tensor | None, Tensor, Tensor]]:
        """One micro-batch's factors of the layers its loss reaches."""
        batch_size = logits.shape[0]
        rows = self.subsampling
        if rows is not None and max(rows) >= batch_size:
            raise IndexError(
                subsample_beyond_batch_message(max(rows), batch_size, "ggn")
            )
        self.deferred.sampled_safely(logits)
        drawn = logits.detach() if rows is None else logits.detach()[rows]
        roots = sampled_gradients(loss, drawn, self.mc_samples, self.generator)
        roots = roots / math.sqrt(self.mc_samples)
        roots /= math.sqrt(mean_normalization(loss, logits))  # BackPACK's order
        if rows is not None:
            roots = roots.new_zeros(self.mc_samples, *logits.shape).index_copy_(
                1, torch.tensor(rows, device=roots.device), roots
            )
        outputs = [output for _, (_, output) in seen]
        if not outputs:  # no collected layer ran for this loss (drawn all the same)
            return {}
        with keeping_stored_io():  # for BackPACK's hooks, where they are not suspended
            samples = [
                torch.autograd.grad(
                    logits,
                    outputs,
                    grad_outputs=root,
                    retain_graph=True,
                    allow_unused=True,
                )
                for root in roots
            ]
        factors = {}
        for index, (module, (inputs, _)) in enumerate(seen):
            if samples[0][index] is None:  # not reached by the loss, as in BackPACK
                continue
            backproped = torch.stack([sample[index] for sample in samples])
            layer_inputs, backproped = layer_rows(module, inputs, backproped)
            if rows is not None:
                layer_inputs, backproped = layer_inputs[rows], backproped[:, rows]
            owned = self._owned[module]
            assert owned is not None
            weight, bias = owned
            first = weight if weight is not None else bias
            assert first is not None
            factors[id(first)] = (
                weight,
                bias,
                *layer_factors(
                    layer_inputs,
                    backproped,
                    bias is not None,
                    weight is None,
                    batch_size,
                ),
            )
        return factors
