"""A refresh's Kronecker factors from one ``torch.autograd.grad``, without BackPACK.

BackPACK back-propagates the loss Hessian's Monte-Carlo square root module by module,
in Python, through hooks on every module; the Kronecker factors need it only at the
layers' outputs. :class:`AutogradFactors` draws the square root at the model's output
(the same draws as BackPACK's pass, from the same generator), back-propagates it with
one ``torch.autograd.grad`` per Monte-Carlo sample to the layers' outputs, kept by
forward hooks, before the closure's own backward (K-FAC's usual implementation), and
turns them and the layers' inputs into the factors ``A`` and ``S`` that the BackPACK
pass's :class:`~dampednewton.backpack.kronecker_hook.FactorCollector` produces.

It covers the refreshes after the first (which runs through BackPACK and checks the
model): one micro-batch through a cross-entropy, a binary cross-entropy or a squared
error on ``[N, C]`` outputs, the collected parameters in ``nn.Linear`` and unfoldable
convolutions that each run once. Anything else (a second micro-batch, a layer run
twice, another loss) leaves the pass :attr:`~AutogradFactors.incomplete`: the step
keeps the stored bases and the next refresh runs through BackPACK, which handles (or
refuses with its message) every case. Hooks the user registered on the tensors
between the model's output and the layers' outputs run once more, in this pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from backpack.core.derivatives.mseloss import MSELossDerivatives
from torch import Generator, Tensor
from torch.nn import (
    BCEWithLogitsLoss,
    Conv1d,
    Conv2d,
    Conv3d,
    CrossEntropyLoss,
    Linear,
    Module,
    MSELoss,
)

from dampednewton.backpack.extensions import subsample_beyond_batch_message
from dampednewton.backpack.kronecker_hook import LayerFactors
from dampednewton.backpack.layers import unfoldable
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.seeding import drawing_from
from dampednewton.math.kronecker_factors import input_factor, output_factor
from dampednewton.math.patches import conv_patches
from dampednewton.math.precision import upcast
from dampednewton.math.sampling import (
    sampled_binary_cross_entropy_gradients,
    sampled_cross_entropy_gradients,
)

Owners = dict[Module, tuple[Tensor | None, Tensor | None]]
"""Each layer's collected ``(weight, bias)`` (``None``: not collected)."""


def layer_owners(modules: Iterable[Module], params: Sequence[Tensor]) -> Owners | None:
    """The layers that hold ``params``, or ``None`` where this pass cannot serve them.

    Args:
        modules: The extended modules that BackPACK's passes ran through.
        params: The parameters whose factors the refresh needs.

    Returns:
        Each layer's collected weight and bias; ``None`` if a parameter is in a
        module that is no ``nn.Linear`` or unfoldable convolution, in two modules,
        or in none of ``modules``.
    """
    wanted = {id(param) for param in params}
    owners: Owners = {}
    found: set[int] = set()
    for module in modules:
        own = [p for p in module.parameters(recurse=False) if id(p) in wanted]
        if not own:
            continue
        if not isinstance(module, Linear | Conv1d | Conv2d | Conv3d) or (
            not isinstance(module, Linear) and not unfoldable(module)
        ):
            return None
        weight = module.weight if id(module.weight) in wanted else None
        bias = (
            module.bias
            if module.bias is not None and id(module.bias) in wanted
            else None
        )
        if len(own) != (weight is not None) + (bias is not None):
            return None
        if any(id(param) in found for param in own):
            return None
        found.update(id(param) for param in own)
        owners[module] = (weight, bias)
    return owners if found == wanted else None


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


SAMPLED_LOSSES = (CrossEntropyLoss, BCEWithLogitsLoss, MSELoss)
"""The losses whose Monte-Carlo square root the autograd pass draws (BackPACK's)."""


def sampled_gradients(
    loss: Module, logits: Tensor, mc_samples: int, generator: Generator | None
) -> Tensor:
    """BackPACK's draws of the loss's gradients at sampled targets, ``[M, N, C]``.

    The same draws as the square-root extension's loss derivatives
    (:mod:`~dampednewton.backpack.loss_derivatives`): the cross-entropies' from the
    generator, the squared error's from BackPACK's Gaussian, drawn from the generator
    through the global random state.

    Args:
        loss: One of :data:`SAMPLED_LOSSES`.
        logits: The (sub-sampled) model outputs ``[N, C]``, detached.
        mc_samples: Draws per sample.
        generator: Their source (``None``: the global random state).

    Returns:
        The gradients, not yet divided by ``√M`` or the mean's normalization.
    """
    if isinstance(loss, CrossEntropyLoss):
        return sampled_cross_entropy_gradients(logits, mc_samples, generator)
    if isinstance(loss, BCEWithLogitsLoss):
        return sampled_binary_cross_entropy_gradients(logits, mc_samples, generator)
    draw = MSELossDerivatives().compute_sampled_grads
    if generator is None:
        return draw(logits.clone(), mc_samples)
    with drawing_from(generator):
        return draw(logits.clone(), mc_samples)


def mean_normalization(loss: Module, logits: Tensor) -> int:
    """What the mean loss divides by: ``N`` for the cross-entropy, else every entry."""
    return logits.shape[0] if isinstance(loss, CrossEntropyLoss) else logits.numel()


class AutogradFactors:
    """A pass's factors through ``torch.autograd.grad``; see the module docstring.

    Args:
        owners: The layers and their collected parameters (:func:`layer_owners`).
        mc_samples: Monte-Carlo samples of the loss Hessian's square root (≥ 1).
        subsampling: The samples the factors are from (``None``: all).
        generator: The draws' source (``None``: the global random state).
        deferred: Where the model output's finiteness is left for the step's read.

    Attributes:
        layers: Each reached layer's factors, by its first parameter's ``id``.
        losses: The loss modules' forward passes seen.
    """

    def __init__(
        self,
        owners: Owners,
        mc_samples: int,
        subsampling: Sequence[int] | None,
        generator: Generator | None,
        deferred: DeferredChecks,
    ):
        """Start with no layer."""
        self.owners = owners
        self.mc_samples = mc_samples
        self.subsampling = None if subsampling is None else list(subsampling)
        self.generator = generator
        self.deferred = deferred
        self.layers: dict[int, LayerFactors] = {}
        self.losses = 0
        self._unsupported = False
        self._ran: set[Module] = set()
        self._seen: dict[Module, tuple[Tensor, Tensor]] = {}

    @property
    def incomplete(self) -> bool:
        """Whether the pass met something it does not cover, or no loss (after it)."""
        return self._unsupported or self.losses != 1

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Keep the layers' inputs and outputs of the forward passes inside.

        Yields:
            Nothing; run the closure inside (with :meth:`loss_ran` called after
            each loss module's forward pass).
        """
        handles = [module.register_forward_hook(self._keep) for module in self.owners]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._ran.clear()
            self._seen.clear()

    def _keep(self, module: Module, inputs: tuple, output: object) -> None:
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        if module in self._ran:  # run twice: tied, recurrent, or two micro-batches
            self._unsupported = True
        self._ran.add(module)
        self._seen[module] = (inputs[0].detach(), output)

    def loss_ran(self, loss: Module, inputs: tuple) -> None:
        """Back-propagate the sampled square root from a loss's input to the layers.

        Args:
            loss: A loss module after its forward pass (already checked).
            inputs: Its inputs (the logits first).
        """
        self.losses += 1
        logits = inputs[0] if inputs else None
        if (
            self.losses > 1
            or self._unsupported
            or not isinstance(loss, SAMPLED_LOSSES)
            or not isinstance(logits, Tensor)
            or logits.dim() != 2
            or not logits.requires_grad
        ):
            self._unsupported = True
            return
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
        layers = list(self._seen.items())
        self._seen.clear()  # the activations are the graph's again, freed by backward
        outputs = [output for _, (_, output) in layers]
        samples = [
            torch.autograd.grad(
                logits, outputs, grad_outputs=root, retain_graph=True, allow_unused=True
            )
            for root in roots
        ]
        for index, (module, (inputs_, _)) in enumerate(layers):
            if samples[0][index] is None:  # not reached by the loss, as in BackPACK
                continue
            backproped = torch.stack([sample[index] for sample in samples])
            layer_inputs, backproped = layer_rows(module, inputs_, backproped)
            if rows is not None:
                layer_inputs, backproped = layer_inputs[rows], backproped[:, rows]
            weight, bias = self.owners[module]
            factors = layer_factors(
                layer_inputs, backproped, bias is not None, weight is None, batch_size
            )
            first = weight if weight is not None else bias
            assert first is not None
            self.layers[id(first)] = LayerFactors(weight, bias, *factors)
