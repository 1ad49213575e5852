"""The loss Hessian's Monte-Carlo square root at the model output, as BackPACK draws it.

The autograd refresh (:mod:`~dampednewton.backpack.autograd_factors`) draws the same
gradients at sampled targets as the square-root extension's loss derivatives
(:mod:`~dampednewton.backpack.loss_derivatives`) and scales them as BackPACK's
``_sqrt_hessian_sampled`` does: by ``1/√M``, then by the square root of the mean's
normalization.
"""

from __future__ import annotations

from backpack.core.derivatives.mseloss import MSELossDerivatives
from torch import Generator, Tensor
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, Module, MSELoss

from dampednewton.backpack.seeding import drawing_from
from dampednewton.math.sampling import (
    sampled_binary_cross_entropy_gradients,
    sampled_cross_entropy_gradients,
)

SAMPLED_LOSSES = (CrossEntropyLoss, BCEWithLogitsLoss, MSELoss)
"""The losses whose Monte-Carlo square root the autograd pass draws (BackPACK's)."""


def sampled_gradients(
    loss: Module, logits: Tensor, mc_samples: int, generator: Generator | None
) -> Tensor:
    """BackPACK's draws of the loss's gradients at sampled targets, ``[M, N, C]``.

    The same draws as the square-root extension's loss derivatives
    (:mod:`~dampednewton.backpack.loss_derivatives`): the cross-entropies' from the
    generator, the squared error's from BackPACK's Gaussian, drawn from the generator
    through the global random state.

    Args:
        loss: One of :data:`SAMPLED_LOSSES`.
        logits: The (sub-sampled) model outputs ``[N, C]``, detached.
        mc_samples: Draws per sample.
        generator: Their source (``None``: the global random state).

    Returns:
        The gradients, not yet divided by ``√M`` or the mean's normalization.
    """
    if isinstance(loss, CrossEntropyLoss):
        return sampled_cross_entropy_gradients(logits, mc_samples, generator)
    if isinstance(loss, BCEWithLogitsLoss):
        return sampled_binary_cross_entropy_gradients(logits, mc_samples, generator)
    draw = MSELossDerivatives().compute_sampled_grads
    if generator is None:
        return draw(logits.clone(), mc_samples)
    with drawing_from(generator):
        return draw(logits.clone(), mc_samples)


def mean_normalization(loss: Module, logits: Tensor) -> int:
    """What the mean loss divides by: ``N`` for the cross-entropy, else every entry."""
    return logits.shape[0] if isinstance(loss, CrossEntropyLoss) else logits.numel()
