"""Curvature traces from BackPACK's diagonal curvature extensions.

The trace of a diagonal approximation is the sum of its entries; summed over a
parameter it is that parameter's block trace, summed over all parameters the total.
With a mean loss BackPACK's diagonals belong to the mean loss's curvature
(``(1/N) Σ_n`` of the per-sample terms).

=================== ============================ =============================
curvature           BackPACK extension           attribute on the parameter
=================== ============================ =============================
``diag_h``          ``DiagHessian()``            ``diag_h``
``diag_ggn_exact``  ``DiagGGNExact()``           ``diag_ggn_exact``
``diag_ggn_mc``     ``DiagGGNMC(mc_samples)``    ``diag_ggn_mc``
=================== ============================ =============================

``DiagGGNMC`` samples from the monitor's generator
(:class:`~dampednewton.diagnostics.draws.SeededDiagGGNMC`), not torch's global one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from backpack.extensions import DiagGGNExact, DiagHessian
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.secondorder.diag_ggn.losses import DiagGGNLoss
from backpack.extensions.secondorder.diag_hessian.losses import DiagHLoss
from torch import Tensor
from torch.nn import BCEWithLogitsLoss

from dampednewton.backpack.added_modules import use_added_modules
from dampednewton.backpack.loss_derivatives import BinaryCrossEntropyDerivatives
from dampednewton.backpack.savefields import DIAG_GGN_EXACT, DIAG_H, DIAGONALS
from dampednewton.diagnostics.draws import SeededDiagGGNMC

CURVATURES: tuple[str, ...] = DIAGONALS
"""Supported curvature names; each is also the attribute BackPACK writes."""


def check_curvature(curvature: str) -> None:
    """Raise if ``curvature`` is not one of :data:`CURVATURES`.

    Args:
        curvature: Name to check.

    Raises:
        ValueError: If the name is unknown.
    """
    if curvature not in CURVATURES:
        raise ValueError(
            f"Unknown curvature {curvature!r}; choose one of {list(CURVATURES)}."
        )


def curvature_extension(curvature: str, mc_samples: int = 1) -> BackpropExtension:
    """BackPACK extension that computes the diagonal named ``curvature``.

    Args:
        curvature: One of :data:`CURVATURES`.
        mc_samples: Monte-Carlo samples, used by ``diag_ggn_mc`` only.

    Returns:
        A fresh extension instance.

    Raises:
        ValueError: If ``curvature`` is unknown.
    """
    check_curvature(curvature)
    # The package's binary cross-entropy derivatives also take (N, C) logits.
    derivatives = BinaryCrossEntropyDerivatives(owner=None)
    if curvature == DIAG_H:
        extension: BackpropExtension = DiagHessian()
        loss_module: Any = DiagHLoss(derivatives=derivatives)
    else:
        extension = (
            DiagGGNExact()
            if curvature == DIAG_GGN_EXACT
            else SeededDiagGGNMC(mc_samples)
        )
        loss_module = DiagGGNLoss(derivatives=derivatives)
    extension.set_module_extension(BCEWithLogitsLoss, loss_module, overwrite=True)
    use_added_modules(extension)
    return extension


def diagonal_trace(diagonal: Tensor) -> Tensor:
    """Trace of a diagonal curvature block: the sum of its entries.

    Args:
        diagonal: Diagonal entries, any shape (e.g. a parameter's ``diag_ggn_exact``).

    Returns:
        0-dim tensor on the device of ``diagonal``.
    """
    return diagonal.detach().sum()


def total_trace(traces: Iterable[Tensor]) -> Tensor:
    """Sum of per-parameter traces.

    Args:
        traces: 0-dim tensors (on one device).

    Returns:
        Their sum as a 0-dim tensor.

    Raises:
        ValueError: If ``traces`` is empty.
    """
    traces = list(traces)
    if not traces:
        raise ValueError("total_trace needs at least one per-parameter trace.")
    return torch.stack(traces).sum()
