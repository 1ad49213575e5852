"""Brute-force float64 references for the GGN, its eigenpairs and the damped step.

Only plain autograd and ``torch.func`` on ordinary (non-BackPACK) models are used.
Modules: ``derivatives`` (losses, gradients, Jacobians, Hessians), ``ggn`` (GGN
blocks, eigenpairs, spectra), ``newton`` (directional derivatives, damped step) and
``validation`` (input checks).

Conventions:
    * The loss uses ``reduction="mean"``: ``L = (1/N) Σ_n ℓ_n`` with the per-sample
      loss ``ℓ_n(f_n) = loss_fn(f_n.unsqueeze(0), y_n.unsqueeze(0))`` (same module).
      For ``MSELoss`` this is ``(1/C)·||f_n − y_n||²``.
    * A parameter group is a list of the model's parameters; vectors over the group
      are the concatenation of ``p.flatten()`` in list order (length D).
    * ``J_n = ∂f_n/∂θ_group`` (C×D), ``H_n = ∇²_f ℓ_n`` (C×C),
      ``G_n = J_nᵀ H_n J_n`` and ``G_S = (1/|S|) Σ_{n∈S} G_n``.
    * Eigenvalues are ascending, eigenvectors are columns (``torch.linalg.eigh``).
"""

from __future__ import annotations

from tests.reference.derivatives import (
    flatten,
    hessian_diagonal,
    loss_hessians,
    output_jacobians,
    per_sample_gradients,
    per_sample_loss,
    per_sample_losses,
    unflatten,
)
from tests.reference.ggn import (
    extra_eigenvalues,
    ggn,
    ggn_diagonal,
    ggn_eigenpairs,
    match_spectra,
    per_sample_ggns,
)
from tests.reference.newton import damped_newton_step, directional_derivatives

__all__ = [
    "damped_newton_step",
    "directional_derivatives",
    "extra_eigenvalues",
    "flatten",
    "ggn",
    "ggn_diagonal",
    "ggn_eigenpairs",
    "hessian_diagonal",
    "loss_hessians",
    "match_spectra",
    "output_jacobians",
    "per_sample_ggns",
    "per_sample_gradients",
    "per_sample_loss",
    "per_sample_losses",
    "unflatten",
]
