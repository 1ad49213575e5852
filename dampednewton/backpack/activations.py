"""Element-wise activations beyond BackPACK's own (GELU, SiLU, Softplus, Mish, …).

BackPACK back-propagates its square roots and diagonals through parameter-free
modules with a module extension per type, and has none for these activations, so a
model with them was refused. Their derivatives (:mod:`dampednewton.math.activations`)
enter BackPACK's :class:`ElementwiseDerivatives`
(:class:`ActivationDerivatives`; for a half-precision model computed in float32
and rounded once, as torch's own backward does), which
:func:`~dampednewton.backpack.added_modules.use_added_modules` registers on each
second-order extension the package creates.
"""

from __future__ import annotations

from collections.abc import Callable

from backpack.core.derivatives.elementwise import ElementwiseDerivatives
from backpack.utils.subsampling import subsample
from torch import Tensor
from torch.nn import GELU, Hardswish, Mish, Module, SiLU, Softplus

from dampednewton.backpack.savefields import module_input
from dampednewton.math import activations
from dampednewton.math.precision import upcast

Derivatives = Callable[[Module, Tensor], tuple[Tensor, Tensor]]
"""``(module, input) -> (f'(input), f''(input))``."""


def _gelu(module: Module, x: Tensor) -> tuple[Tensor, Tensor]:
    assert isinstance(module, GELU)
    return activations.gelu(x, module.approximate)


def _silu(module: Module, x: Tensor) -> tuple[Tensor, Tensor]:
    return activations.silu(x)


def _softplus(module: Module, x: Tensor) -> tuple[Tensor, Tensor]:
    assert isinstance(module, Softplus)
    return activations.softplus(x, module.beta, module.threshold)


def _mish(module: Module, x: Tensor) -> tuple[Tensor, Tensor]:
    return activations.mish(x)


def _hardswish(module: Module, x: Tensor) -> tuple[Tensor, Tensor]:
    return activations.hardswish(x)


ACTIVATIONS: dict[type[Module], Derivatives] = {
    GELU: _gelu,
    SiLU: _silu,
    Softplus: _softplus,
    Mish: _mish,
    Hardswish: _hardswish,
}
"""The activations the package adds, with their derivatives."""


class ActivationDerivatives(ElementwiseDerivatives):
    """BackPACK's element-wise derivatives from one entry of :data:`ACTIVATIONS`."""

    def __init__(self, derivatives: Derivatives):
        """Keep the derivatives.

        Args:
            derivatives: ``(module, input) -> (f', f'')``.
        """
        super().__init__()
        self._derivatives = derivatives

    def hessian_is_zero(self, module: Module) -> bool:
        """None of these activations is piece-wise linear."""
        return False

    def df(
        self,
        module: Module,
        g_inp: tuple[Tensor],
        g_out: tuple[Tensor],
        subsampling: list[int] | None = None,
    ) -> Tensor:
        """``f'`` at the module's stored input (its sub-sampled samples)."""
        x = subsample(module_input(module), subsampling=subsampling)
        return self._derivatives(module, upcast(x))[0].to(x.dtype)

    def d2f(self, module: Module, g_inp: tuple[Tensor], g_out: tuple[Tensor]) -> Tensor:
        """``f''`` at the module's stored input."""
        x = module_input(module)
        return self._derivatives(module, upcast(x))[1].to(x.dtype)


ACTIVATION_DERIVATIVES: dict[type[Module], ActivationDerivatives] = {
    module_class: ActivationDerivatives(derivatives)
    for module_class, derivatives in ACTIVATIONS.items()
}
"""BackPACK's derivatives of each of :data:`ACTIVATIONS`."""
