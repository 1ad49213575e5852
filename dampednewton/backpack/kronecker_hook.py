"""A layer's Kronecker factors from BackPACK's structured square-root buffers.

During a refresh pass the structured square-root extensions
(:mod:`~dampednewton.backpack.layers`) leave on each ``nn.Linear`` and
``nn.Conv1d/2d/3d`` weight its inputs (unfolded for convolutions) and the GGN's
square root back-propagated to its output. :class:`FactorCollector` is the pass's
hook: per layer it turns them into the input factor ``A`` and the output factor
``S`` of :mod:`dampednewton.math.kronecker` and frees nothing (the pass frees the
buffers after every hook ran).

A closure may back-propagate several micro-batches (gradient accumulation): each
micro-batch's factors enter with the weight of its loss (the gradient that reached
the loss module, ``N_m/N`` or ``1/M``), normalized by the weights' sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.nn import Module
from torch.nn.modules.loss import _Loss

from dampednewton.backpack.buffers import LinearBuffers, SharedLinearBuffers
from dampednewton.backpack.savefields import module_input
from dampednewton.backpack.unsupported import tied_parameter_message
from dampednewton.math.kronecker_factors import input_factor, output_factor
from dampednewton.math.precision import upcast

UNSUPPORTED_LAYER = (
    "The Kronecker basis (DampedNewton's default) covers nn.Linear and "
    "nn.Conv1d/2d/3d layers (groups=1, zero padding given by numbers); the "
    "parameter {name} of {module} is none of these. Use basis=GramBasis() (the "
    "group's leading GGN eigenvectors from the Gram matrix, any layer BackPACK "
    "supports) for the whole optimizer."
)


@dataclass
class LayerFactors:
    """A layer's parameters and its factors' weighted sums over a pass's micro-batches.

    After one micro-batch (the usual closure) the factors are that micro-batch's own,
    unweighted (``total`` is ``None``): a second one first weighs them with
    ``first_weight``.

    Attributes:
        weight: The layer's weight, ``None`` where it is not collected.
        bias: Its bias, ``None`` where it is not collected (or absent).
        inputs: ``Σ_m w_m A_m`` ``[d_in (+1), d_in (+1)]`` (one micro-batch: ``A``).
        outputs: ``Σ_m w_m S_m`` ``[d_out, d_out]`` (one micro-batch: ``S``).
        total: ``Σ_m w_m`` (0-dim; ``None`` after one micro-batch).
        first_weight: The first micro-batch's loss weight ``w_1`` (``None``: 1).
        passes: The micro-batches (backward passes) that reached the layer.
    """

    weight: Tensor | None
    bias: Tensor | None
    inputs: Tensor
    outputs: Tensor
    total: Tensor | None = None
    first_weight: Tensor | None = None
    passes: int = 1

    @property
    def first(self) -> Tensor:
        """The parameter that holds the layer's state: its weight, else its bias."""
        first = self.weight if self.weight is not None else self.bias
        assert first is not None
        return first

    def weigh(self) -> Tensor:
        """Turn one micro-batch's factors into weighted sums; return ``Σ_m w_m``."""
        if self.total is None:
            scale = _as_scale(self.first_weight, self.inputs)
            self.inputs, self.outputs = self.inputs * scale, self.outputs * scale
            self.total = scale
        return self.total

    def add(self, inputs: Tensor, outputs: Tensor, loss_weight: Tensor | None) -> None:
        """Add a further micro-batch's factors with its loss weight."""
        total = self.weigh()
        scale = _as_scale(loss_weight, inputs)
        self.inputs += inputs * scale
        self.outputs += outputs * scale
        self.total = total + scale
        self.passes += 1

    def mean(self) -> tuple[Tensor, Tensor]:
        """``(A, S)`` of the pass: the micro-batches' weighted means."""
        if self.total is None:
            return self.inputs, self.outputs
        return self.inputs / self.total, self.outputs / self.total


def _as_scale(loss_weight: Tensor | None, like: Tensor) -> Tensor:
    """A micro-batch's loss weight as a 0-dim tensor like ``like`` (``1``: unknown)."""
    if loss_weight is None:
        return like.new_ones(())
    return loss_weight.detach().to(like).reshape(())


class FactorCollector:
    """The refresh pass's hook: every collected layer's factors.

    Args:
        savefield: Where the square-root extension stores its buffers.
        params: The parameters whose layers are collected.
        extension: The square-root extension (it records each micro-batch's loss
            weight at the loss module).
        subsampled: Whether the square roots cover a sub-sample of each pass.
    """

    def __init__(
        self,
        savefield: str,
        params: Sequence[Tensor],
        extension: object,
        subsampled: bool = False,
    ):
        """Start with no layer."""
        self.savefield = savefield
        self.params = {id(p) for p in params}
        self.extension = extension
        self.subsampled = subsampled
        self.layers: dict[int, LayerFactors] = {}
        self._modules: dict[int, int] = {}  # the module of each layer's first param
        self._loss_weight: Tensor | None = None
        self._batch_size = 0
        self._passes = 0

    def check_every_pass_reached_every_layer(self) -> None:
        """Refuse micro-batches that reached different layers (after the closure).

        The batch's factors weigh each micro-batch's by its loss weight over all of
        them: a layer some micro-batch did not reach (a head of another loss on
        the same samples) would get its own micro-batches' curvature undiluted.

        Raises:
            RuntimeError: Naming what to do, as the Gram basis does.
        """
        missed = [
            layer for layer in self.layers.values() if layer.passes < self._passes
        ]
        if missed:
            raise RuntimeError(
                f"DampedNewton refused the step: of the closure's {self._passes} "
                f"backward passes, {missed[0].passes} reached a layer of shape "
                f"{tuple(missed[0].first.shape)} (several losses of one batch, "
                "such as heads of a multi-task model back-propagated one by one?), "
                "so the batch's curvature cannot be assembled: every micro-batch "
                "must run through the same layers; parameters and optimizer state "
                "unchanged."
            )

    def hook(self, module: Module) -> None:
        """Collect the factors of ``module`` (BackPACK's ``extension_hook``).

        Raises:
            NotImplementedError: For a parameter of the optimizer in a layer the
                Kronecker basis does not cover, or in two modules.
            ValueError: For several micro-batches with a sub-sample.
        """
        if isinstance(module, _Loss):
            self._passes += 1
            if self._passes > 1 and self.subsampled:
                raise ValueError(
                    "The closure back-propagated several micro-batches (gradient "
                    "accumulation), but subsampling_ggn selects samples of one "
                    "backward pass. Use subsampling_ggn=None with gradient "
                    "accumulation."
                )
            self._loss_weight = getattr(self.extension, "loss_weight", None)
            self._batch_size = module_input(module).shape[0]
            return
        weight = _collected(getattr(module, "weight", None), self.params)
        bias = _collected(getattr(module, "bias", None), self.params)
        first = weight if weight is not None else bias
        for param in module.parameters(recurse=False):
            if id(param) in self.params and param is not weight and param is not bias:
                raise NotImplementedError(_unsupported(param, module))
        if first is None:
            return
        buffers = getattr(first, self.savefield, None)
        if not isinstance(buffers, LinearBuffers | SharedLinearBuffers) or (
            weight is not None and buffers.inputs is None
        ):
            raise NotImplementedError(_unsupported(first, module))
        inputs, outputs = layer_factors(
            buffers, bias is not None, weight is None, self._batch_size
        )
        if self._modules.setdefault(id(first), id(module)) != id(module):
            raise NotImplementedError(tied_parameter_message(first, module))
        layer = self.layers.get(id(first))
        if layer is None:
            self.layers[id(first)] = LayerFactors(
                weight, bias, inputs, outputs, first_weight=self._loss_weight
            )
        else:
            layer.add(inputs, outputs, self._loss_weight)


def _collected(param: object, params: set[int]) -> Tensor | None:
    return param if isinstance(param, Tensor) and id(param) in params else None


def _unsupported(param: Tensor, module: Module) -> str:
    return UNSUPPORTED_LAYER.format(
        name=f"of shape {tuple(param.shape)}", module=module
    )


def layer_factors(
    buffers: LinearBuffers | SharedLinearBuffers,
    bias: bool,
    bias_only: bool,
    batch_size: int,
) -> tuple[Tensor, Tensor]:
    """``(A, S)`` of one micro-batch from a layer's buffers.

    Args:
        buffers: The weight's buffers (or, for ``bias_only``, the bias's).
        bias: Whether the layer's bias is collected with it (``x̃`` ends with 1).
        bias_only: The buffers are a bias's whose weight is not collected: ``A`` is
            ``[[1]]`` and ``S`` the bias's own GGN block.
        batch_size: ``N`` of the micro-batch (BackPACK's square roots carry
            ``1/√N``; a sub-sample of ``N'`` samples is rescaled to its own mean).

    Returns:
        The input and output factors.
    """
    backproped = upcast(buffers.backproped)
    num_samples = backproped.shape[1]
    scale = batch_size / num_samples if batch_size else 1.0
    outputs = output_factor(backproped, scale)
    if bias_only:
        ones = backproped.new_zeros(num_samples, 1, 0)
        return input_factor(ones, True, num_samples), outputs
    assert buffers.inputs is not None
    return input_factor(upcast(buffers.inputs), bias, num_samples), outputs
