"""Gram-space algebra of the GGN's square root ``V`` (pure tensor functions).

A parameter's GGN square root is stored as a tensor ``[C, N, *p.shape]`` (``C``
output dimensions or Monte-Carlo samples, ``N`` samples). Flattened to ``[C·N, D_p]``
its rows are the columns of ``V`` restricted to that parameter, indexed by
``c·N + n``. A GGN block stacks the rows of its parameters along ``D``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def flatten_sqrt_ggn(sqrt_ggn: Tensor) -> Tensor:
    """Flatten a square-root tensor ``[C, N, *shape]`` to ``[C·N, D_p]``.

    Args:
        sqrt_ggn: Square root of one parameter's GGN block in BackPACK's layout.

    Returns:
        Matrix whose rows are the (Gram-space indexed) columns of ``V``.
    """
    return sqrt_ggn.flatten(start_dim=2).flatten(end_dim=1)


def gram_contribution(sqrt_ggn_flat: Tensor) -> Tensor:
    """One parameter's contribution ``V_pᵀ V_p`` to the Gram matrix.

    Args:
        sqrt_ggn_flat: Flattened square root ``[C·N, D_p]``.

    Returns:
        ``[C·N, C·N]`` matrix; the block's Gram matrix is the sum over parameters.
    """
    return sqrt_ggn_flat @ sqrt_ggn_flat.T


def gradient_contribution(gradients_flat: Tensor, sqrt_ggn_flat: Tensor) -> Tensor:
    """One parameter's contribution to the products of gradients with ``V``.

    Args:
        gradients_flat: Gradients ``[N', D_p]`` (one row per gradient).
        sqrt_ggn_flat: Flattened square root ``[C·N, D_p]``.

    Returns:
        ``[N', C·N]`` matrix ``g_n'ᵀ V_p``; the block's product sums over parameters.
    """
    return gradients_flat @ sqrt_ggn_flat.T


def map_to_parameter(gram_vectors: Tensor, sqrt_ggn_flat: Tensor) -> Tensor:
    """Map Gram-space vectors to one parameter's space: ``V_p β``.

    Args:
        gram_vectors: ``[C·N]`` vector or ``[C·N, K]`` matrix of Gram-space vectors.
        sqrt_ggn_flat: Flattened square root ``[C·N, D_p]``.

    Returns:
        ``[D_p]`` vector or ``[K, D_p]`` matrix (one row per Gram-space vector).
    """
    return torch.tensordot(gram_vectors, sqrt_ggn_flat, dims=([0], [0]))
