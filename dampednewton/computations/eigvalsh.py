"""GGN eigenvalues from the Gram matrix."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Generator, Tensor

from dampednewton.computations.block import Block
from dampednewton.computations.engine import GGNEngine, GGNSettings
from dampednewton.computations.interface import GGNComputation
from dampednewton.math.linalg import symmetric_eigvalsh


class EigvalshComputation(GGNComputation[Tensor]):
    """BackPACK extension and hook that compute GGN eigenvalues.

    Each parameter group is one GGN block; its Gram matrix ``VᵀV`` (size ``C·N``) has
    the block's non-zero eigenvalues. ``get_result(group)`` returns all ``C·N`` Gram
    eigenvalues in ascending order.

    The loss must use ``reduction='mean'``.
    """

    def __init__(
        self,
        subsampling: Sequence[int] | None = None,
        mc_samples: int = 0,
        verbose: bool = False,
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
            generator: Random source for Monte-Carlo sampling (``None``: global).
            structured: Exploit ``nn.Linear``'s Kronecker structure (``False``:
                materialize square roots and individual gradients, the reference).
        """
        settings = GGNSettings(
            subsampling_ggn=subsampling,
            ggn_argument="subsampling",
            mc_samples=mc_samples,
            verbose=verbose,
            generator=generator,
            structured=structured,
        )
        self._engine = GGNEngine(settings, self._finish)

    def _finish(self, block: Block) -> Tensor:
        return symmetric_eigvalsh(block.reduced_gram)

    def get_result(self, group: dict) -> Tensor:
        """Return a block's Gram eigenvalues (ascending) after the backward pass.

        Args:
            group: Parameter group that defines the GGN block.

        Returns:
            One-dimensional tensor with ``C·N`` eigenvalues.

        Raises:
            KeyError: If there is no result for the group.
        """
        return self._result(group)
