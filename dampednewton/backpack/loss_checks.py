"""Checks of the loss module and its targets, and the checks a step reads later.

:class:`DeferredChecks` collects device-side checks of BackPACK's hooks so that the
optimizer reads them with the step's other checks in one host read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, Module, MSELoss
from torch.nn.modules.loss import _Loss

from dampednewton.backpack.private import registered_module_types
from dampednewton.math.finite import finite_flag

DEFAULT_IGNORE_INDEX = -100


def supported_modules(extension: BackpropExtension) -> list[str]:
    """The names of the module types ``extension`` supports, sorted."""
    return sorted(cls.__name__ for cls in registered_module_types(extension))


def check_reduction(loss: _Loss) -> None:
    """Refuse a loss that does not average over the batch, saying what to do.

    Args:
        loss: A loss module.

    Raises:
        ValueError: For ``reduction='sum'`` or ``'none'``.
    """
    reduction = getattr(loss, "reduction", "mean")
    if reduction != "mean":
        raise ValueError(
            f"{type(loss).__name__} uses reduction='{reduction}', but the GGN "
            "computations and the "
            "diagnostics assume reduction='mean' (steps and per-sample quantities "
            f"would be off by the batch size). Use {type(loss).__name__}"
            "(reduction='mean')."
        )


def check_loss_options(loss: _Loss) -> None:
    """Refuse loss options whose GGN BackPACK does not compute, saying what to do.

    BackPACK's square root of the loss Hessian assumes that every sample enters the
    mean with weight ``1/N``. Class weights (``CrossEntropyLoss(weight=...)``,
    ``BCEWithLogitsLoss(weight=..., pos_weight=...)``) and ignored targets break
    that; BackPACK refuses the weights and a non-default ``ignore_index`` with a
    generic message and silently includes targets equal to the default
    ``ignore_index=-100``. ``label_smoothing`` is fine: the cross-entropy's Hessian
    with respect to the logits, ``diag(p) − p pᵀ``, does not depend on the targets.

    Args:
        loss: A loss module during the backward pass (BackPACK stored its targets as
            ``input1``).

    Raises:
        ValueError: For a reduction other than the mean (:func:`check_reduction`),
            class weights or a non-default ``ignore_index`` (targets equal to it:
            :func:`check_targets`).
    """
    check_reduction(loss)
    for option in ("weight", "pos_weight"):
        if getattr(loss, option, None) is not None:
            name = type(loss).__name__
            raise ValueError(
                f"{name}({option}=...) is not supported. Use {name}() without "
                "weights and rebalance by sampling instead (e.g. "
                "torch.utils.data.WeightedRandomSampler with per-sample weights): "
                "BackPACK's GGN assumes that every sample enters the mean loss with "
                "weight 1/N."
            )
    if isinstance(loss, CrossEntropyLoss) and loss.ignore_index != DEFAULT_IGNORE_INDEX:
        raise ValueError(
            f"CrossEntropyLoss(ignore_index={loss.ignore_index}) is not supported: "
            f"BackPACK implements only the default ignore_index={DEFAULT_IGNORE_INDEX}"
            " (and no target may equal it). Use CrossEntropyLoss(). "
            + drop_ignored_samples(loss.ignore_index)
        )


def check_loss_shapes(loss: _Loss, outputs: Tensor | None, targets: Tensor | None):
    """Refuse loss shapes whose GGN is not computed, or that broadcast.

    BackPACK's ``MSELoss`` takes ``(N, D)`` outputs and targets of the same shape;
    other shapes fail inside BackPACK, or broadcast to an ``(N, N)`` loss (torch only
    warns) whose curvature is not the model's. The binary cross-entropy's derivatives
    (:mod:`.loss_derivatives`) take ``(N, C)`` logits and targets.

    Args:
        loss: A loss module.
        outputs: Its first input, the model output (``None``: unknown).
        targets: Its second input (``None``: unknown).

    Raises:
        ValueError: For ``MSELoss`` or ``BCEWithLogitsLoss`` outputs that are not
            2-d, or targets of another shape.
    """
    if outputs is None or targets is None:
        return
    if isinstance(loss, BCEWithLogitsLoss) and (
        outputs.dim() != 2 or targets.shape != outputs.shape
    ):
        raise ValueError(
            f"BCEWithLogitsLoss got model outputs of shape {tuple(outputs.shape)} "
            f"and targets of shape {tuple(targets.shape)}, but the GGN needs both of "
            "shape (N, C) (C outputs per sample, each a binary label). For one "
            "output per sample, use (N, 1): a final nn.Linear(..., 1) without a "
            "squeeze, and targets.float().view(-1, 1)." + _flatten_advice(outputs)
        )
    if not isinstance(loss, MSELoss):
        return
    if outputs.dim() != 2 or targets.shape != outputs.shape:
        raise ValueError(
            f"MSELoss got model outputs of shape {tuple(outputs.shape)} and targets "
            f"of shape {tuple(targets.shape)}, but BackPACK's GGN needs both of "
            "shape (N, D). For one output per sample, use (N, 1): e.g. a final "
            "nn.Linear(..., 1) and targets.view(-1, 1)." + _flatten_advice(outputs)
        )


def _flatten_advice(outputs: Tensor) -> str:
    """For outputs of more than two dimensions: flatten them inside the model."""
    if outputs.dim() <= 2:
        return ""
    return (
        " For outputs of several dimensions per sample (an image, a mask), end the "
        "model with nn.Flatten() and flatten the targets alike: "
        "loss_fn(model(inputs), targets.flatten(1))."
    )


def targets_error(invalid: int, deferred: DeferredChecks) -> ValueError:
    """The error for invalid targets (:func:`check_targets`).

    Args:
        invalid: How many targets are invalid.
        deferred: The step's checks (the kind of targets, their number).

    Returns:
        The error to raise.
    """
    if deferred.binary_targets:
        return ValueError(
            f"{invalid} of the {deferred.num_targets} targets of BCEWithLogitsLoss lie "
            "outside [0, 1] (labels -1/+1?), where the loss is unbounded below. Use "
            "labels 0 and 1 (e.g. (targets + 1) / 2) or probabilities."
        )
    return ignored_targets_error(invalid, deferred.num_targets, deferred.ignore_index)


def ignored_targets_error(ignored: int, total: int, ignore_index: int) -> ValueError:
    """The error for targets equal to the cross-entropy's ``ignore_index``.

    Args:
        ignored: How many targets equal it.
        total: Number of targets.
        ignore_index: The loss's ``ignore_index``.

    Returns:
        The error to raise.
    """
    return ValueError(
        f"{ignored} of the {total} targets equal CrossEntropyLoss's "
        f"ignore_index={ignore_index}: the loss averages over the other "
        "samples, BackPACK's GGN over all of them, so the step would be "
        f"wrong. {drop_ignored_samples(ignore_index)}"
    )


def drop_ignored_samples(ignore_index: int) -> str:
    """How to leave samples out of the loss instead of ``ignore_index``."""
    return (
        "Drop the samples to ignore before the model instead: keep = targets != "
        f"{ignore_index}; loss_fn(model(inputs[keep]), targets[keep]) (outputs "
        "indexed between the model and the loss are hidden from BackPACK). Targets "
        "per position (sequences, segmentation masks) cannot be ignored: BackPACK's "
        "GGN takes every position."
    )


@dataclass
class DeferredChecks:
    """Checks of the loss's inputs left on the device for the step to read.

    An extension with ``deferred_checks`` set to such an object records them here
    instead of reading them on the host at once (one synchronization each): the
    optimizer reads all of a step's checks together
    (``dampednewton._step.step_status``).
    It also never raises on a non-finite model output: it samples from zeros
    instead, and the step is refused. Shared by the extensions of one step, whose
    closure may back-propagate several micro-batches: counts add up, flags combine.

    Attributes:
        ignored_targets: Number of invalid targets (0-dim): equal to the
            cross-entropy's ``ignore_index``, or outside ``[0, 1]`` for the binary
            cross-entropy (``binary_targets``).
        num_targets: Number of targets.
        ignore_index: The cross-entropy's ``ignore_index``.
        binary_targets: Whether the targets are the binary cross-entropy's.
        model_output_finite: Whether the model output reaching the loss is finite
            (0-dim), where a Monte-Carlo extension sampled from it.
        loss_unscaled: Whether the gradient reaching the loss was 1 (0-dim): BackPACK's
            check that ``backward`` was called on the loss itself, not on a multiple.
            For several micro-batches: whether their weights (the gradients
            reaching their losses) sum to 1, up to rounding.
        loss_name: The loss module, for the warning.
        loss_weights: The gradient reaching the loss in each micro-batch's backward
            pass (0-dim each).
        local_samples: Samples of this process's batch (its micro-batches'), as the
            loss modules saw them (0: not counted).
    """

    ignored_targets: Tensor | None = None
    num_targets: int = 0
    ignore_index: int = DEFAULT_IGNORE_INDEX
    binary_targets: bool = False
    model_output_finite: Tensor | None = None
    loss_unscaled: Tensor | None = None
    loss_name: str = ""
    loss_weights: list[Tensor] = field(default_factory=list)
    local_samples: int = 0

    def add_loss_weight(self, weight: Tensor) -> None:
        """Record a micro-batch's loss weight and update :attr:`loss_unscaled`.

        Args:
            weight: The gradient reaching the loss (0-dim).
        """
        self.loss_weights.append(weight.detach())
        if len(self.loss_weights) == 1:
            self.loss_unscaled = (weight == 1.0).all()
            return
        total = torch.stack(self.loss_weights).sum()
        rounding = 8 * len(self.loss_weights) * torch.finfo(total.dtype).eps
        self.loss_unscaled = (total - 1.0).abs() <= rounding

    def add_model_output_finite(self, finite: Tensor) -> None:
        """Combine a micro-batch's finiteness flag of the model output.

        Args:
            finite: Whether its model output is finite (0-dim).
        """
        previous = self.model_output_finite
        self.model_output_finite = finite if previous is None else previous & finite

    def sampled_safely(self, output: Tensor) -> None:
        """Flag whether ``output`` is finite and zero its non-finite entries in place.

        A step must not raise inside backward (under data parallelism the other
        ranks would wait): Monte-Carlo sampling draws from the outputs with their
        non-finite entries zeroed (in place, a no-op when all are finite: BackPACK
        keys the backpropagated quantity by data_ptr) and the step is refused.
        Through ``.data``: autograd's version counter stays, so a last layer that
        saved its output (Sigmoid, Tanh, ReLU) still back-propagates.

        Args:
            output: The model output reaching the loss.
        """
        self.add_model_output_finite(finite_flag(output))
        output.data.nan_to_num_(0.0, 0.0, 0.0)


def check_targets(
    loss: _Loss, deferred: DeferredChecks | None, targets: Tensor | None = None
) -> None:
    """Refuse invalid targets, or defer the check.

    Cross-entropy targets equal to ``ignore_index``; binary cross-entropy targets
    outside ``[0, 1]`` (e.g. labels −1/+1), where its loss is unbounded below.

    Args:
        loss: A loss module during the backward pass (targets in ``input1``).
        deferred: Where to leave the count instead of checking it (``None``: check
            now, one host synchronization).
        targets: The targets, where BackPACK did not store them (a pass without
            its hooks); ``None``: ``loss.input1``.

    Raises:
        ValueError: Without ``deferred``, for an invalid target.
    """
    if targets is None:
        targets = getattr(loss, "input1", None)
    if targets is None:
        return
    binary = isinstance(loss, BCEWithLogitsLoss)
    if binary:
        invalid = ((targets < 0) | (targets > 1)).sum()
    elif isinstance(loss, CrossEntropyLoss) and not targets.is_floating_point():
        invalid = (targets == loss.ignore_index).sum()
    else:
        return
    ignore_index = loss.ignore_index if isinstance(loss, CrossEntropyLoss) else None
    if deferred is None:
        checked = DeferredChecks(num_targets=targets.numel(), binary_targets=binary)
        if ignore_index is not None:
            checked.ignore_index = ignore_index
        if int(invalid):
            raise targets_error(int(invalid), checked)
        return
    previous = deferred.ignored_targets
    deferred.ignored_targets = invalid if previous is None else previous + invalid
    deferred.num_targets += targets.numel()
    deferred.binary_targets = deferred.binary_targets or binary
    if ignore_index is not None:
        deferred.ignore_index = ignore_index


def check_plain_loss_call(
    loss: Module, inputs: tuple[Tensor, ...], deferred: DeferredChecks | None
) -> None:
    """The checks of a loss module's forward pass in a pass without BackPACK's hooks.

    The steps between curvature refreshes run no extension, so the loss's options
    and targets are checked here, as the extensions check them in a refresh: a
    mistake is refused on whichever step it appears.

    Args:
        loss: A BackPACK-extended loss module that just ran.
        inputs: Its forward inputs (the model output, the targets).
        deferred: Where to leave the targets' count for the step's host read
            (``None``: check now).

    Raises:
        ValueError: For an option BackPACK's GGN does not support
            (:func:`check_loss_options`).
        RuntimeError: Under ``torch.autocast``.
    """
    if not isinstance(loss, _Loss):
        return
    check_loss_options(loss)
    if inputs and _autocast_enabled(inputs[0].device.type):
        raise RuntimeError(
            "The closure runs under torch.autocast, whose mixed dtypes BackPACK "
            "cannot back-propagate (refused at every step, also between curvature "
            "refreshes). Run the closure without autocast and hold the model in "
            "half precision instead (model.to(torch.bfloat16)): DampedNewton "
            "computes its curvature and step in float32."
        )
    if deferred is not None and inputs:
        deferred.local_samples += inputs[0].shape[0]
    if len(inputs) > 1:
        check_loss_shapes(loss, inputs[0], inputs[1])
        check_targets(loss, deferred, inputs[1])


def _autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for the device type (torch 2.4's API too)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # before the device_type argument
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled()
        return torch.is_autocast_enabled()
