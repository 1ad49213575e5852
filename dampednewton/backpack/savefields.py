"""Names of the attributes that BackPACK's extensions write on parameters."""

from __future__ import annotations

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
