"""GGN eigenpairs: Gram eigenvalues and parameter-space eigenvectors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Generator, Tensor

from dampednewton.computations.block import Block, to_parameter_space
from dampednewton.computations.engine import GGNEngine, GGNSettings
from dampednewton.computations.interface import GGNComputation
from dampednewton.computations.selection import select_directions


class EighComputation(GGNComputation[tuple[Tensor, list[Tensor]]]):
    """BackPACK extension and hook that compute GGN eigenpairs.

    Each group needs ``'params'`` (one GGN block) and ``'criterion'`` (ascending
    eigenvalues → indices, or an int ``k`` for the ``k`` largest positive ones). The
    eigenvector of a selected eigenvalue ``λ_k`` with Gram eigenvector ``ũ_k`` is
    ``e_k = V ũ_k / ‖V ũ_k‖``, normalised by its actual norm in parameter space as in
    ViViT (not by ``√λ_k``, whose round-off spoils the norm for small ``λ_k``).
    Criteria may select eigenvalues that are zero up to round-off or negative, such as
    ViViT's keep-all ``lambda evals: list(range(evals.numel()))``: that warns, and
    their eigenvectors are normalised round-off (the zero vector where ``V ũ_k``
    vanishes exactly).

    The loss must use ``reduction='mean'``.
    """

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
        *,
        generator: Generator | None = None,
        structured: bool = True,
    ):
        """Specify the GGN approximation (none by default).

        Args:
            subsampling: Samples used for the GGN; ``None`` uses the whole batch.
            mc_samples: ``0`` for the exact GGN, else Monte-Carlo samples of the loss
                Hessian's square root.
            verbose: Print what happens during backpropagation.
            warn_small_eigvals: Warn when a selected eigenvalue's magnitude is below
                this (``0`` disables the warning).
            generator: Random source for Monte-Carlo sampling (``None``: global).
            structured: Exploit ``nn.Linear``'s Kronecker structure (``False``:
                materialize square roots and individual gradients, the reference).
        """
        settings = GGNSettings(
            subsampling_ggn=subsampling,
            ggn_argument="subsampling",
            mc_samples=mc_samples,
            verbose=verbose,
            warn_small_eigvals=warn_small_eigvals,
            generator=generator,
            structured=structured,
        )
        self._engine = GGNEngine(
            settings,
            self._finish,
            required_group_keys=("criterion",),
            keeps_factors=True,
        )

    def _finish(self, block: Block) -> tuple[Tensor, list[Tensor]]:
        directions = select_directions(block, self._engine.settings.warn_small_eigvals)
        return directions.evals, unit_columns(
            to_parameter_space(block, directions.gram_evecs)
        )

    def get_result(self, group: dict) -> tuple[Tensor, list[Tensor]]:
        """Return the selected eigenvalues and eigenvectors of a block.

        Args:
            group: Parameter group that defines the GGN block.

        Returns:
            Eigenvalues ``[K]`` (ascending) and, per parameter ``p`` of the group, a
            tensor ``[K, *p.shape]``: eigenvector ``k`` is ``[v[k] for v in evecs]``.

        Raises:
            KeyError: If there is no result for the group.
        """
        return self._result(group)


def unit_columns(vectors: list[Tensor]) -> list[Tensor]:
    """Normalise ``K`` stacked vectors in parameter format to unit norm.

    Args:
        vectors: Per parameter, a tensor ``[K, *p.shape]``; vector ``k`` is
            ``[v[k] for v in vectors]``.

    Returns:
        The vectors divided by their norms (zero vectors stay zero).
    """
    squared_norms = cast(
        Tensor, sum(v.flatten(start_dim=1).square().sum(1) for v in vectors)
    )
    norms = squared_norms.sqrt()
    scale = torch.where(norms > 0, norms.reciprocal(), 0.0)
    return [v * scale.view(-1, *([1] * (v.dim() - 1))) for v in vectors]
