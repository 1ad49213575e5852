"""Adaptive average pooling's derivatives for BackPACK's second-order extensions.

BackPACK has no module extension for ``AdaptiveAvgPool1d/2d/3d`` on its square roots
(``SqrtGGNExact``, ``SqrtGGNMC``), so a CNN with a global average pooling head was
refused, and its diagonals' derivatives handle only input sizes that are multiples of
the output sizes, in float32. :class:`AdaptiveAvgPoolDerivatives` applies the
pooling's transposed Jacobian as one matrix per spatial dimension
(:mod:`dampednewton.math.adaptive_pooling`): every size, every dtype. The pooling is
linear, so its Hessian is zero.
"""

from __future__ import annotations

from backpack.core.derivatives.basederivatives import BaseDerivatives
from backpack.utils.subsampling import subsample
from torch import Tensor
from torch.nn import AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d, Module

from dampednewton.backpack.savefields import module_input
from dampednewton.math.adaptive_pooling import adaptive_average_transposed


class AdaptiveAvgPoolDerivatives(BaseDerivatives):
    """The transposed Jacobian of ``AdaptiveAvgPool{N}d``.

    Attributes:
        spatial: ``N``, the pooled dimensions.
    """

    def __init__(self, spatial: int):
        """Pool ``spatial`` trailing dimensions.

        Args:
            spatial: 1, 2 or 3.
        """
        super().__init__()
        self.spatial = spatial

    def hessian_is_zero(self, module: Module) -> bool:
        """The pooling is linear."""
        return True

    def _jac_t_mat_prod(
        self,
        module: Module,
        g_inp: tuple[Tensor],
        g_out: tuple[Tensor],
        mat: Tensor,
        subsampling: list[int] | None = None,
    ) -> Tensor:
        """``Jᵀ mat`` for ``mat`` ``[V, N', C, *output]``: ``[V, N', C, *input]``."""
        inputs = subsample(module_input(module), subsampling=subsampling)
        sizes = tuple(inputs.shape[-self.spatial :])
        return adaptive_average_transposed(mat, sizes)


ADAPTIVE_POOLS: dict[type[Module], AdaptiveAvgPoolDerivatives] = {
    AdaptiveAvgPool1d: AdaptiveAvgPoolDerivatives(1),
    AdaptiveAvgPool2d: AdaptiveAvgPoolDerivatives(2),
    AdaptiveAvgPool3d: AdaptiveAvgPoolDerivatives(3),
}
"""The pooling modules and their derivatives."""
