"""The only uses of BackPACK's private API, one function each.

BackPACK (1.x) exposes none of these publicly. If a BackPACK release changes
them, this module is the one place to adapt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from backpack.context import CTX
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.module_extension import ModuleExtension


def default_param_function(
    module_extension: ModuleExtension, param_name: str
) -> Callable:
    """BackPACK's own per-parameter computation of a module extension.

    The structured module extensions fall back to it for configurations they do not
    handle (e.g. grouped convolutions). BackPACK builds it with the protected
    ``_make_param_function``; there is no public way to call the default.

    Args:
        module_extension: The module extension (a subclass of BackPACK's).
        param_name: ``"weight"`` or ``"bias"``.

    Returns:
        A function ``(ext, module, g_inp, g_out, backproped) -> quantity``.
    """
    return module_extension._make_param_function(param_name)


def registered_module_types(extension: BackpropExtension) -> list[type]:
    """The module types an extension has module extensions for.

    Only used for error messages. BackPACK keeps its registry in the name-mangled
    attribute ``_BackpropExtension__module_extensions`` and has no accessor.

    Args:
        extension: A BackPACK extension.

    Returns:
        The registered module classes (empty should BackPACK rename the attribute).
    """
    return list(getattr(extension, "_BackpropExtension__module_extensions", {}))


@contextmanager
def keeping_stored_io() -> Iterator[None]:
    """Keep the inputs and outputs BackPACK's hooks stored through a backward pass.

    BackPACK's backward hook deletes a module's stored forward inputs and output once
    it ran, unless the context's ``retain_graph`` flag is set (it has no public
    setter). A backward pass inside this block (the autograd refresh's, before the
    closure's own) leaves them for the closure's backward pass.

    Yields:
        Nothing; back-propagate inside.
    """
    previous = CTX.get_retain_graph()
    CTX.set_retain_graph(True)
    try:
        yield
    finally:
        CTX.set_retain_graph(previous)
