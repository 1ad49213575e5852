"""BackPACK extensions used by the computations, with errors that say what to do.

BackPACK's own errors surface deep inside ``loss.backward()`` and name BackPACK's
internals; these subclasses translate the common ones (unsupported layer, BatchNorm in
training mode, loss not extended) and let Monte-Carlo sampling draw from a
``torch.Generator`` instead of the global random state.
"""

from __future__ import annotations

from collections.abc import Sequence

from backpack.extensions import BatchGrad, SqrtGGNExact, SqrtGGNMC
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Generator, Tensor, float32
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.loss import _Loss

from dampednewton.backpack.added_modules import use_added_modules
from dampednewton.backpack.backward import check_fresh_forward
from dampednewton.backpack.loss_checks import (
    DeferredChecks,
    check_loss_options,
    check_loss_shapes,
    check_targets,
    supported_modules,
)
from dampednewton.backpack.loss_derivatives import (
    SAMPLED_WITH_GENERATOR,
    set_loss_extensions,
)
from dampednewton.backpack.savefields import module_input
from dampednewton.backpack.seeding import drawing_from
from dampednewton.backpack.unsupported import (
    batch_norm_training_message,
    check_supported_configuration,
    custom_module_message,
)
from dampednewton.math.finite import all_finite


def _run_translating_errors(
    extension: BackpropExtension,
    call: type,
    module: Module,
    g_inp: tuple[Tensor],
    g_out: tuple[Tensor],
) -> None:
    check_fresh_forward(module)
    if isinstance(module, _Loss):
        check_loss_options(module)
        check_loss_shapes(module, module_input(module), getattr(module, "input1", None))
        deferred = getattr(extension, "deferred_checks", None)
        check_targets(module, deferred)
    else:
        check_no_autocast(module)
        check_supported_configuration(module)
        if isinstance(extension, SqrtGGNExact | SqrtGGNMC):
            check_backpropagated_shape(extension, module)
    try:
        call.__call__(extension, module, g_inp, g_out)
    except NotImplementedError as error:
        if isinstance(module, _BatchNorm) and module.training:
            raise RuntimeError(batch_norm_training_message(module)) from error
        supported = supported_modules(extension)
        if type(module).__name__ in supported:
            raise NotImplementedError(
                f"BackPACK's {type(extension).__name__} supports "
                f"{type(module).__name__}, but not this configuration of it: {error}"
            ) from error
        if next(module.children(), None) is not None:
            raise NotImplementedError(
                custom_module_message(module, type(extension).__name__, supported)
            ) from error
        if isinstance(module, _Loss):
            raise NotImplementedError(
                f"BackPACK's {type(extension).__name__} cannot handle the loss "
                f"{module}. Supported losses: CrossEntropyLoss, MSELoss and "
                "BCEWithLogitsLoss (for NLLLoss after LogSoftmax: CrossEntropyLoss "
                "on the logits)."
            ) from error
        raise NotImplementedError(
            f"BackPACK's {type(extension).__name__} cannot handle module {module} "
            f"({type(module).__module__}.{type(module).__name__}). Supported modules: "
            f"{', '.join(supported)}. Replace the layer by a "
            "supported one or exclude its parameters from the model."
        ) from error
    except IndexError as error:
        subsampling = extension.get_subsampling()
        if subsampling is None:
            raise
        option = "grad" if isinstance(extension, BatchGrad) else "ggn"
        samples = module_input(module) if isinstance(module, _Loss) else g_out[0]
        raise IndexError(
            subsample_beyond_batch_message(max(subsampling), samples.shape[0], option)
        ) from error
    except AssertionError as error:
        if "expects a backpropagation quantity" in str(error):
            raise RuntimeError(
                f"No curvature information reached {module}. Either the loss "
                "function, or a module between it and this one (an activation, a "
                "layer added after extend), is not extended with BackPACK: call "
                "`loss_fn = backpack.extend(loss_fn)` and `model = "
                "backpack.extend(model)` after the model's last change. Or the "
                "forward pass applies a function or tensor operation after this "
                "module (torch.relu, x.mean(...), indexing the outputs), which "
                "BackPACK cannot back-propagate through: use modules (nn.ReLU, "
                "nn.Flatten, nn.AvgPool2d, ...) in an nn.Sequential. Or the closure "
                "ran another forward pass of the model after the one the loss took "
                "(an auxiliary or metric pass): run it under torch.no_grad()."
            ) from error
        raise
    except RuntimeError as error:
        message = str(error)
        if "Difference in dimension must be 1" in message:
            raise RuntimeError(reshape_message(module)) from error
        if "Compared shapes" in message and not isinstance(module, _Loss):
            raise RuntimeError(
                changed_output_message(module, str(error.args[0]).strip())
            ) from error
        mixed_dtypes = (
            "expected scalar type",
            "should be the same",
            "to have the same dtype",
        )
        dtype = g_out[0].dtype if g_out and g_out[0] is not None else float32
        if dtype != float32 and any(text in message for text in mixed_dtypes):
            raise RuntimeError(
                f"BackPACK's derivatives of {type(module).__name__} fail in "
                f"{dtype} (they create float32 tensors): hold the model in "
                "float32."
            ) from error
        raise


def subsample_beyond_batch_message(largest: int, batch_size: int, option: str) -> str:
    """The error for sample indices beyond the batch.

    Args:
        largest: The largest index.
        batch_size: The batch's samples.
        option: ``"ggn"`` or ``"grad"``: which of DampedNewton's options selects them.

    Returns:
        The error's text.
    """
    return (
        f"The sample indices select sample {largest}, but this batch has "
        f"{batch_size} samples. Pass indices below the smallest batch size "
        f"(subsampling_{option}=range(min(32, batch_size)) of DampedNewton, or the "
        "computations' subsampling), or None for all, or drop an epoch's last, "
        "smaller batch (DataLoader(..., drop_last=True))."
    )


def reshape_message(module: Module) -> str:
    """The error for a module output reshaped in ``forward`` before the next module."""
    return (
        f"BackPACK cannot back-propagate through a reshape, transpose or permute "
        f"after {module} (`x.view(...)`, `x.reshape(...)`, `x.transpose(...)` in "
        "forward): flatten with nn.Flatten() or torch.flatten(x, 1) instead, and "
        "give a loss per position the layout the model's last layer produces."
    )


def changed_output_message(module: Module, shapes: str) -> str:
    """The error for a module output changed before the loss (e.g. sliced)."""
    return (
        f"What BackPACK back-propagated to {module} does not fit its output "
        f"({shapes}): the forward pass changes it before the loss (indexing or "
        "slicing the outputs, a tensor operation), which BackPACK cannot "
        "back-propagate through. Pass the module's output on unchanged (e.g. a final "
        "nn.Linear with as many outputs as the loss takes), or make the operation a "
        "module."
    )


def check_backpropagated_shape(extension: BackpropExtension, module: Module) -> None:
    """Refuse a square root whose shape per sample is not the output's.

    BackPACK files the quantity it back-propagates under the address of the tensor
    it belongs to; a slice of a module's output (``outputs[:, :3]``) starts at the
    same address, so the module would receive the slice's square root. The quantity
    is ``[V, N', *output.shape[1:]]``, with ``N'`` the sub-sampled samples.

    Args:
        extension: A square-root extension during the backward pass.
        module: The module about to receive its quantity (BackPACK stored its output).

    Raises:
        RuntimeError: If the quantity's trailing shape is not the output's.
    """
    output = getattr(module, "output", None)
    saved = getattr(extension.saved_quantities, "_saved_quantities", {})
    if not isinstance(output, Tensor):
        return
    quantity = saved.get(output.data_ptr())
    if not isinstance(quantity, Tensor) or quantity.shape[2:] == output.shape[1:]:
        return
    if quantity.shape[2:].numel() == output.shape[1:].numel():
        raise RuntimeError(reshape_message(module))
    raise RuntimeError(
        changed_output_message(
            module,
            f"{list(quantity.shape[2:])} per sample back-propagated, "
            f"{list(output.shape[1:])} produced",
        )
    )


def check_no_autocast(module: Module) -> None:
    """Refuse a layer whose output's dtype is not its parameters' (``torch.autocast``).

    Under autocast a float32 layer computes in bfloat16 or float16, and BackPACK
    would back-propagate the loss Hessian's square root in that dtype into float32
    parameters. A model held in half precision works instead: its curvature is
    computed in float32 (:mod:`~dampednewton.math.precision`).

    Args:
        module: A module during the backward pass (BackPACK stored its output).

    Raises:
        RuntimeError: If a floating-point parameter's dtype differs from the output's.
    """
    output = getattr(module, "output", None)
    if not isinstance(output, Tensor) or not output.is_floating_point():
        return
    for param in module.parameters(recurse=False):
        if param.is_floating_point() and param.dtype != output.dtype:
            raise RuntimeError(
                f"{module} has {param.dtype} parameters but computed its output in "
                f"{output.dtype}: the closure runs under torch.autocast, whose mixed "
                "dtypes BackPACK cannot back-propagate. Run the closure without "
                "autocast and hold the model in half precision instead "
                "(model.to(torch.bfloat16)): DampedNewton computes its Gram matrix, "
                "eigendecomposition and step in float32 and rounds the update to "
                "the parameters' dtype."
            )


class NonFiniteModelOutput(FloatingPointError):
    """The model output reaching the loss is not finite: no GGN can be sampled."""


def modified_loss_warning(loss_name: str, micro_batches: int = 1) -> str:
    """BackPACK's warning for a loss whose output gradient is not 1.

    Args:
        loss_name: The loss module.
        micro_batches: Backward passes of the closure through the loss; for several,
            the warning is about their weights, which do not sum to 1.

    Returns:
        The warning's text.
    """
    if micro_batches > 1:
        return (
            f"The closure back-propagated {micro_batches} micro-batches through "
            f"{loss_name} with weights (the factors multiplying their mean losses) "
            "that do not sum to 1, so .grad is a multiple of the batch's mean "
            "gradient while the curvature is the batch's own. Multiply the loss of "
            "micro-batch m by N_m / N (its share of the batch), or by 1/M for M "
            "micro-batches of equal size."
        )
    return (
        f"The output of {loss_name} seems to have been modified. Backpack might give "
        "wrong second-order information. Make sure you call backward() on the output "
        "of a loss function module from torch.nn"
    )


def _record_loss_weight(
    extension: ExactSqrtGGN | MonteCarloSqrtGGN, module: Module, g_out: tuple[Tensor]
) -> None:
    """Keep the gradient reaching a loss module: its micro-batch's weight.

    A closure that accumulates gradients back-propagates each micro-batch's mean
    loss times a weight (``1/M``, or ``N_m/N``); BackPACK's square root is that of
    the mean loss, without the weight (see ``dampednewton.backpack.micro_batches``).
    """
    if isinstance(module, _Loss):
        extension.loss_weight = g_out[0].detach()


class ExactSqrtGGN(SqrtGGNExact):
    """:class:`backpack.extensions.SqrtGGNExact` with actionable error messages.

    Attributes:
        deferred_checks: Where the loss's checks are left (``None``: check now).
        loss_weight: The gradient that reached the loss module in the last backward
            pass (0-dim): the weight of a micro-batch's loss.
    """

    def __init__(self, subsampling: Sequence[int] | None = None):
        """Set up BackPACK's extension and the losses' deferred checks.

        Args:
            subsampling: Indices of the samples used, ``None`` for all.
        """
        super().__init__(subsampling=subsampling)
        self.deferred_checks: DeferredChecks | None = None
        self.loss_weight: Tensor | None = None
        set_loss_extensions(self)
        use_added_modules(self)

    def __call__(self, module: Module, g_inp: tuple[Tensor], g_out: tuple[Tensor]):
        """Run BackPACK's extension, translating its errors."""
        _record_loss_weight(self, module, g_out)
        _run_translating_errors(self, SqrtGGNExact, module, g_inp, g_out)


class MonteCarloSqrtGGN(SqrtGGNMC):
    """:class:`backpack.extensions.SqrtGGNMC` drawing from a private generator.

    BackPACK samples the loss Hessian's square root with the global random state. With a
    ``generator``, results are reproducible and the user's global random stream is
    untouched: the cross-entropy draws its labels from the generator directly
    (:func:`~dampednewton.math.sampling.sampled_cross_entropy_gradients`); the other
    losses sample inside a forked random state seeded from the generator, whose state
    then advances.

    Attributes:
        generator: The random source (``None``: the global random state).
        deferred_checks: Where the loss's checks are left (``None``: check now).
        loss_weight: The gradient that reached the loss module in the last backward
            pass (0-dim): the weight of a micro-batch's loss.
    """

    def __init__(
        self,
        mc_samples: int,
        subsampling: Sequence[int] | None = None,
        generator: Generator | None = None,
    ):
        """Store the sampling settings.

        Args:
            mc_samples: Number of Monte-Carlo samples.
            subsampling: Indices of the samples used, ``None`` for all.
            generator: Source of randomness, ``None`` for the global random state.
        """
        super().__init__(mc_samples=mc_samples, subsampling=subsampling)
        self.generator = generator
        self.deferred_checks: DeferredChecks | None = None
        self.loss_weight: Tensor | None = None
        set_loss_extensions(self, generator)
        use_added_modules(self)

    def __call__(self, module: Module, g_inp: tuple[Tensor], g_out: tuple[Tensor]):
        """Run BackPACK's extension; sample from the generator at the loss."""
        check_fresh_forward(module)
        _record_loss_weight(self, module, g_out)
        if isinstance(module, _Loss):
            output = module_input(module)
            if self.deferred_checks is None:
                if not all_finite(output):
                    raise NonFiniteModelOutput(
                        "The model output is not finite, so the loss Hessian cannot "
                        "be sampled (Monte-Carlo GGN)."
                    )
            else:
                self.deferred_checks.sampled_safely(output)
        self._sample(module, g_inp, g_out)

    def _sample(self, module: Module, g_inp: tuple[Tensor], g_out: tuple[Tensor]):
        """Run BackPACK's extension, drawing from the generator at the loss."""
        if (
            self.generator is None
            or not isinstance(module, _Loss)
            or isinstance(module, SAMPLED_WITH_GENERATOR)
        ):
            _run_translating_errors(self, SqrtGGNMC, module, g_inp, g_out)
            return
        with drawing_from(self.generator):
            _run_translating_errors(self, SqrtGGNMC, module, g_inp, g_out)


class IndividualGradients(BatchGrad):
    """:class:`backpack.extensions.BatchGrad` with actionable error messages."""

    deferred_checks: DeferredChecks | None = None

    def __call__(self, module: Module, g_inp: tuple[Tensor], g_out: tuple[Tensor]):
        """Run BackPACK's extension, translating its errors."""
        _run_translating_errors(self, BatchGrad, module, g_inp, g_out)
