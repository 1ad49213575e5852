"""The modules the package adds to BackPACK's second-order extensions, in one place.

BackPACK back-propagates its square roots and diagonals through a module with a
module extension per module type and extension. :func:`use_added_modules` registers
the package's derivatives of the modules BackPACK leaves out (the activations of
:mod:`~dampednewton.backpack.activations`, the adaptive average pooling of
:mod:`~dampednewton.backpack.adaptive_pooling`) on each second-order extension the
package creates: the GGN's square roots (exact and Monte-Carlo: the optimizer and
the computations) and the curvature traces' diagonals (GGN and Hessian).
First-order extensions need no module extension for a parameter-free module.
"""

from __future__ import annotations

from backpack.core.derivatives.basederivatives import BaseDerivatives
from backpack.extensions import (
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.secondorder.diag_ggn.diag_ggn_base import DiagGGNBaseModule
from backpack.extensions.secondorder.diag_hessian.diag_h_base import DiagHBaseModule
from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule
from torch.nn import Module

from dampednewton.backpack.activations import ACTIVATION_DERIVATIVES
from dampednewton.backpack.adaptive_pooling import ADAPTIVE_POOLS

ADDED_MODULES: dict[type[Module], BaseDerivatives] = {
    **ACTIVATION_DERIVATIVES,
    **ADAPTIVE_POOLS,
}
"""Every module type the package adds, with its derivatives."""

MODULE_EXTENSIONS: dict[type[BackpropExtension], type] = {
    SqrtGGNExact: SqrtGGNBaseModule,
    SqrtGGNMC: SqrtGGNBaseModule,
    DiagGGNExact: DiagGGNBaseModule,
    DiagGGNMC: DiagGGNBaseModule,
    DiagHessian: DiagHBaseModule,
}
"""Each second-order extension's module-extension class for parameter-free modules."""


def use_added_modules(extension: BackpropExtension) -> None:
    """Register :data:`ADDED_MODULES` on a second-order extension.

    Args:
        extension: An instance of (a subclass of) a key of :data:`MODULE_EXTENSIONS`.

    Raises:
        TypeError: For another extension.
    """
    base = next(
        (
            module_extension
            for kind, module_extension in MODULE_EXTENSIONS.items()
            if isinstance(extension, kind)
        ),
        None,
    )
    if base is None:
        raise TypeError(
            f"No module extensions for parameter-free modules on "
            f"{type(extension).__name__}."
        )
    for module_class, derivatives in ADDED_MODULES.items():
        extension.set_module_extension(
            module_class, base(derivatives=derivatives), overwrite=True
        )
