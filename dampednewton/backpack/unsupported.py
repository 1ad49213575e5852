"""What to say when BackPACK cannot handle a model: the error's advice."""

from __future__ import annotations

from collections.abc import Sequence

from torch.nn import Module


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
    unsupported = (
        f" Of its submodules, BackPACK does not support {', '.join(sorted(leaves))} "
        "either; replace them by supported modules."
        if leaves
        else ""
    )
    return (
        f"BackPACK's {extension} cannot handle {name}, a custom module with "
        "submodules: backpack.extend treats every module but nn.Sequential as one "
        f"operation, and has no rule for {name}.{unsupported} Write the model as an "
        "nn.Sequential of supported modules, or let BackPACK convert it: `model = "
        "backpack.extend(model, use_converter=True)` (torch.fx; it also handles "
        f"residual connections). Supported modules: {', '.join(supported)}."
    )
