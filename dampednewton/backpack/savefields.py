"""Names of the attributes that BackPACK's extensions write on parameters.

And :func:`module_input`, the input BackPACK keeps on each extended module.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor
from torch.nn import Module

SQRT_GGN_EXACT = "sqrt_ggn_exact"
"""``SqrtGGNExact``: the GGN's square root (or structured buffers)."""

SQRT_GGN_MC = "sqrt_ggn_mc"
"""``SqrtGGNMC``: its Monte-Carlo estimate (or structured buffers)."""

SQRT_GGNS = (SQRT_GGN_EXACT, SQRT_GGN_MC)
"""Both square roots."""

GRAD_BATCH = "grad_batch"
"""``BatchGrad``: individual gradients ``∇ℓ_n/N``."""

SUM_GRAD_SQUARED = "sum_grad_squared"
"""``SumGradSquared``: ``Σ_n (∇ℓ_n/N)²``."""

DIAG_H = "diag_h"
"""``DiagHessian``: the Hessian's diagonal."""

DIAG_GGN_EXACT = "diag_ggn_exact"
"""``DiagGGNExact``: the GGN's diagonal."""

DIAG_GGN_MC = "diag_ggn_mc"
"""``DiagGGNMC``: its Monte-Carlo estimate."""

DIAGONALS = (DIAG_H, DIAG_GGN_EXACT, DIAG_GGN_MC)
"""The diagonal curvatures."""


def sqrt_ggn_savefield(mc_samples: int) -> str:
    """Attribute of the GGN square root: exact for ``0``, else Monte-Carlo.

    Args:
        mc_samples: Monte-Carlo samples (``0``: exact).

    Returns:
        :data:`SQRT_GGN_EXACT` or :data:`SQRT_GGN_MC`.
    """
    return SQRT_GGN_MC if mc_samples > 0 else SQRT_GGN_EXACT


def module_input(module: Module) -> Tensor:
    """The input of the last forward pass that BackPACK stored on a module.

    Args:
        module: A module extended with ``backpack.extend`` whose forward pass ran.

    Returns:
        Its ``input0``.
    """
    # torch types module attributes as Tensor | Module; BackPACK stores a Tensor.
    return cast(Tensor, module.input0)
