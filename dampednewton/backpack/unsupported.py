"""What to say when BackPACK cannot handle a model: the error's advice.

Besides the modules BackPACK has no rule for, some configurations of supported ones
have rules that are wrong: its convolution derivatives take ``padding`` as numbers
and zeros, so a ``padding="same"`` or a ``padding_mode`` other than ``"zeros"`` would
give a silently wrong curvature and individual gradients, for the layer and for
every layer before it (:func:`check_supported_configuration` refuses them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd, _ConvTransposeNd

NO_LOSS_MODULE = (
    "DampedNewton refused the step: the closure's loss came from no BackPACK-extended "
    "loss module (a functional loss such as F.cross_entropy, or a loss module that is "
    "not extended), so its curvature is unknown; parameters and optimizer state "
    "unchanged. Use loss_fn = backpack.extend(nn.CrossEntropyLoss()) (or MSELoss, "
    "BCEWithLogitsLoss) and loss = loss_fn(model(inputs), targets)."
)

LOSS_INPUT_NOT_MODEL_OUTPUT = (
    "DampedNewton refused the step: {loss} took the model's output through an "
    "operation (such as model(inputs) / 2, indexing or torch.relu, or the autograd "
    "function that DistributedDataParallel puts there with find_unused_parameters="
    "True or static_graph=True), which BackPACK's curvature cannot pass, so the "
    "gradient and the curvature would describe different losses; parameters and "
    "optimizer state unchanged. Pass the model's output to the loss module as it "
    "is, put such operations inside the model as modules (nn.ReLU, nn.Flatten, ...) "
    "in an nn.Sequential, and leave DistributedDataParallel's options at their "
    "defaults."
)

LOSS_INPUT_PART_OF_OUTPUT = (
    "DampedNewton refused the step: {loss} took a part {taken} of the model's output "
    "{output} (slicing, e.g. model(inputs)[:16] or model(inputs)[:, :3]), but "
    "BackPACK's curvature is that of the whole output; parameters and optimizer "
    "state unchanged. Drop samples before the model (model(inputs[keep])), and give "
    "the model's last layer as many outputs as the loss takes."
)

LOSS_INPUT_REARRANGED_OUTPUT = (
    "DampedNewton refused the step: {loss} took the model's output {output} "
    "reshaped, transposed or permuted to {taken}, but BackPACK's curvature keeps the "
    "output's layout; parameters and optimizer state unchanged. Give the loss the "
    "output as the model's last layer produces it: for a loss per position "
    "(CrossEntropyLoss on (N, C, T)), end the model with a layer that outputs that "
    "layout, e.g. an nn.Conv1d(channels, C, 1) head on (N, channels, T) features."
)

LOSS_INPUT_OF_EARLIER_FORWARD = (
    "DampedNewton refused the step: {loss} took the output of a forward pass of the "
    "model after which the closure ran another one with gradients (an auxiliary or "
    "metric pass, or the forward passes of several micro-batches before their "
    "losses), and BackPACK keeps only the last forward pass's inputs; parameters "
    "and optimizer state unchanged. Run such passes under torch.no_grad(), and one "
    "forward and one backward pass per micro-batch, in turn (docs/accumulation.md)."
)


def batch_norm_training_message(module: Module) -> str:
    """Why a BatchNorm layer in training mode is refused, and what to do."""
    return (
        f"{module} is in training mode: it mixes the samples of a batch, so "
        "per-sample GGN factors and gradients are not defined (refused at every "
        "step, also between curvature refreshes). Call model.eval() on the "
        "BatchNorm layers (or remove them) before the step."
    )


def check_batch_norms_in_eval(modules: Iterable[Module]) -> None:
    """Refuse a BatchNorm layer of ``modules`` in training mode.

    Raises:
        RuntimeError: Naming the layer, with what to do.
    """
    for module in modules:
        if isinstance(module, _BatchNorm) and module.training:
            raise RuntimeError(batch_norm_training_message(module))


def custom_module_message(
    module: Module, extension: str, supported: Sequence[str]
) -> str:
    """What to do about a custom module (one with submodules) BackPACK cannot handle.

    ``backpack.extend`` gives every module but the containers it knows
    (``nn.Sequential``) its hooks, and treats each as one operation: a model class
    whose ``forward`` calls its submodules has no rule of its own.

    Args:
        module: The custom module.
        extension: The BackPACK extension's name.
        supported: The names of the modules the extension supports.

    Returns:
        The message, naming the submodules that are not supported either.
    """
    name = type(module).__name__
    leaves = {
        type(child).__name__
        for child in module.modules()
        if next(child.children(), None) is None
        and type(child).__name__ not in supported
    }
    head = (
        f"BackPACK's {extension} cannot handle {name}, a custom module with "
        "submodules: backpack.extend treats every module but nn.Sequential as one "
        f"operation, and has no rule for {name}."
    )
    if leaves:  # converting it would not help
        return (
            f"{head} Of its submodules, BackPACK does not support "
            f"{', '.join(sorted(leaves))} either: the model needs supported modules "
            f"only. Supported modules: {', '.join(supported)}."
        )
    return (
        f"{head} Write the model as an nn.Sequential of supported modules, or let "
        "BackPACK convert it: `model = backpack.extend(model, use_converter=True)` "
        "(torch.fx; it also handles residual connections). Supported modules: "
        f"{', '.join(supported)}."
    )


def check_supported_configuration(module: Module) -> None:
    """Refuse a configuration whose BackPACK derivatives are wrong or crash.

    Args:
        module: A module the backward pass reached.

    Raises:
        NotImplementedError: For a convolution with a ``padding_mode`` other than
            ``"zeros"`` or ``padding="same"``, and a transposed convolution with
            ``output_padding``.
    """
    if not isinstance(module, _ConvNd):
        return
    name = type(module).__name__
    wrong = (
        "BackPACK's convolution derivatives take the padding as numbers of zeros, so "
        "the curvature and individual gradients of this layer and of every layer "
        "before it would be wrong."
    )
    if module.padding_mode != "zeros":
        raise NotImplementedError(
            f"{name}(padding_mode={module.padding_mode!r}) is not supported: {wrong} "
            "Use padding_mode='zeros'."
        )
    if module.padding == "same":
        sizes = [
            d * (k - 1)
            for d, k in zip(module.dilation, module.kernel_size, strict=True)
        ]
        fix = (
            f"padding={tuple(size // 2 for size in sizes)}, the same function"
            if all(size % 2 == 0 for size in sizes)
            else "an odd kernel size with padding=(kernel_size - 1) // 2, or pad "
            "the input with a supported padding module before the layer"
        )
        raise NotImplementedError(
            f"{name}(padding='same') is not supported: {wrong} Use {fix}."
        )
    if isinstance(module, _ConvTransposeNd) and any(module.output_padding):
        raise NotImplementedError(
            f"{name}(output_padding={module.output_padding}) is not supported: "
            "BackPACK's transposed-convolution derivatives do not take it. Use "
            "output_padding=0 (e.g. kernel_size=4, stride=2, padding=1 doubles the "
            "size as kernel_size=3, stride=2, padding=1, output_padding=1 does)."
        )


def tied_parameter_message(param: Tensor, module: Module) -> str:
    """Why a parameter used by two modules (weight tying) is refused.

    Args:
        param: The parameter.
        module: The second module that uses it.

    Returns:
        The message.
    """
    return (
        f"A parameter of shape {tuple(param.shape)} is used by two modules (weight "
        f"tying; the second is {module}): BackPACK computes each module's "
        "quantities apart, so its curvature would be that of one use. Untie the "
        "weights, or leave the tied parameter out of the optimizer (step it with "
        "another one, e.g. torch.optim.Adam, in the same closure)."
    )
