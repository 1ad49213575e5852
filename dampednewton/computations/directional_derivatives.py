"""First- and second-order directional derivatives along GGN eigenvectors."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Generator, Tensor

from dampednewton.computations.block import Block, slope_products
from dampednewton.computations.engine import GGNEngine, GGNSettings
from dampednewton.computations.interface import GGNComputation
from dampednewton.computations.selection import Directions, select_directions
from dampednewton.math.gram_space import directional_curvatures, directional_gradients


class DirectionalDerivativesComputation(GGNComputation[tuple[Tensor, Tensor]]):
    """BackPACK extensions and hook for ``γ_nk`` and ``λ_nk`` along GGN eigenvectors.

    ``γ_nk = ∇ℓ_nᵀ e_k`` is the slope of sample ``n``'s loss ``ℓ_n`` (not ``ℓ_n/N``),
    ``λ_nk = e_kᵀ G_n e_k`` its GGN curvature; the mean of ``λ_nk`` over the GGN
    samples is the eigenvalue ``λ_k``. Groups need ``'params'`` and ``'criterion'``.
    The directions are :class:`EighComputation`'s unit eigenvectors
    ``e_k = V ũ_k / ‖V ũ_k‖``, also for eigenvalues that are zero up to round-off or
    negative (which warns, as in ViViT); where ``V ũ_k`` vanishes exactly, the
    derivatives are zero.

    The loss must use ``reduction='mean'``.
    """

    def __init__(
        self,
        subsampling_grad: Sequence[int] | None = None,
        subsampling_ggn: Sequence[int] | None = None,
        mc_samples_ggn: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
        *,
        generator: Generator | None = None,
        structured: bool = True,
    ):
        """Specify the gradient and GGN approximations (none by default).

        Args:
            subsampling_grad: Samples for the directional gradients (``None``: all).
            subsampling_ggn: Samples for directions and curvatures (``None``: all).
            mc_samples_ggn: ``0`` for the exact GGN, else Monte-Carlo samples.
            verbose: Print what happens during backpropagation.
            warn_small_eigvals: Warn when a selected eigenvalue's magnitude is below.
            generator: Random source for Monte-Carlo sampling (``None``: global).
            structured: Exploit ``nn.Linear``'s Kronecker structure (``False``:
                materialize square roots and individual gradients, the reference).
        """
        settings = GGNSettings(
            subsampling_ggn=subsampling_ggn,
            subsampling_grad=subsampling_grad,
            mc_samples=mc_samples_ggn,
            verbose=verbose,
            warn_small_eigvals=warn_small_eigvals,
            generator=generator,
            structured=structured,
        )
        self._engine = GGNEngine(
            settings,
            self._finish,
            required_group_keys=("criterion",),
            needs_gradients=True,
        )

    def _finish(self, block: Block) -> tuple[Tensor, Tensor]:
        directions = select_directions(block, self._engine.settings.warn_small_eigvals)
        return slopes_and_curvatures(block, directions, slope_products(block, True))

    def get_result(self, group: dict) -> tuple[Tensor, Tensor]:
        """Return the directional derivatives of a block.

        Args:
            group: Parameter group that defines the GGN block.

        Returns:
            ``γ`` as ``[N_grad, K]`` and ``λ`` as ``[N_ggn, K]`` tensors.

        Raises:
            KeyError: If there is no result for the group.
        """
        return self._result(group)


def slopes_and_curvatures(
    block: Block, directions: Directions, gradient_products: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-sample slopes ``γ`` and curvatures ``λ`` along a block's directions.

    Args:
        block: A block whose parameters were all reduced.
        directions: Its selected directions.
        gradient_products: ``[N', C·N]`` products ``gₙᵀ V`` (or ``[1, C·N]`` of the
            mean gradient).

    Returns:
        ``γ`` as ``[N', K]`` and ``λ`` as ``[N_ggn, K]`` tensors.
    """
    gammas = directional_gradients(
        gradient_products, directions.gram_evecs, directions.lengths
    )
    lambdas = directional_curvatures(
        directions.gram_images,
        directions.lengths,
        block.num_outputs,
        block.num_samples,
    )
    return gammas, lambdas
